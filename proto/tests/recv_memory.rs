//! The receive bound counts memory, not payload (issue 14, item 4): a peer
//! that sends 1-byte `Data` frames to a paused reader must not make a stream
//! hold much more memory than its receive bound.
//!
//! A counting global allocator measures the heap the stream state really
//! holds once `recv_has_room` says stop.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use bytes::Bytes;
use tether_proto::frame::{Frame, StreamId};
use tether_proto::stream::{ReadOutcome, StreamLimits, StreamState};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const RECV: usize = 1 << 20;

fn limits() -> StreamLimits {
    StreamLimits {
        replay_bytes: RECV,
        recv_bytes: RECV,
        max_payload: 16 * 1024,
    }
}

/// Feeds frames of `size` bytes until the stream says it has no room
/// (bounded), and returns (frames, heap bytes held by the stream).
fn fill(size: usize) -> (u64, isize) {
    let before = LIVE.load(Ordering::Relaxed);
    let id: StreamId = 1;
    let mut s = StreamState::new(id, limits());
    let mut offset = 0u64;
    let mut frames = 0u64;
    while s.recv_has_room() && frames < 5_000_000 {
        let payload = Bytes::from(vec![b'x'; size]);
        s.on_frame(Frame::Data {
            stream: id,
            offset,
            payload,
        })
        .unwrap();
        offset += size as u64;
        frames += 1;
    }
    let held = LIVE.load(Ordering::Relaxed) - before;
    // Everything received is still readable, in order.
    let mut got = 0u64;
    while let ReadOutcome::Data(d) = s.read(64 * 1024) {
        assert!(d.iter().all(|&b| b == b'x'));
        got += d.len() as u64;
    }
    assert_eq!(got, offset);
    (frames, held)
}

#[test]
fn one_byte_frames_to_a_paused_reader_hold_about_the_bound() {
    let (frames, held) = fill(1);
    println!("1-byte frames: {frames} accepted, {held} bytes of heap held");
    assert!(
        held < 3 * RECV as isize,
        "a paused reader's stream holds {held} bytes for {frames} one-byte frames (bound {RECV})"
    );
}

#[test]
fn full_frames_still_fill_the_bound() {
    let (frames, held) = fill(16 * 1024);
    println!("16 KiB frames: {frames} accepted, {held} bytes of heap held");
    assert!(frames as usize * 16 * 1024 >= RECV - 16 * 1024 - 64 * 64);
    assert!(held < 3 * RECV as isize, "{held} bytes held");
}
