//! Every bound the protocol enforces, with its default.
//!
//! Both ends carry a [`Limits`] and announce it (edge in the hello, cloud in
//! the welcome); each side then sends with [`Limits::agree`]: frames and data
//! payloads no bigger than *both* accept, so neither ever sends a frame the
//! other would reject. Buffers and stream counts stay each side's own. Each field is a
//! configuration key of both binaries (same name, `--kebab-case` flag).

use serde::{Deserialize, Serialize};

/// Most pods one pod report may carry: the cloud closes the connection of an
/// edge that reports more (a protocol violation), so an edge caps its report
/// here as it caps it to what fits in one frame.
pub const MAX_POD_REPORT: usize = 100_000;

/// Size and count bounds of the wire protocol and of each stream's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest encoded frame accepted on any stream (length prefix excluded).
    /// A peer that announces a bigger frame is a protocol error on that QUIC
    /// stream only.
    pub max_frame_bytes: u32,
    /// Largest data payload put in one `Data` frame by a sender.
    pub max_data_payload: u32,
    /// Largest encoded request or response head (all header names and values).
    pub max_head_bytes: u32,
    /// Bytes written by the local side but not yet acknowledged as delivered by
    /// the peer, per stream direction. When full, the writer stops reading its
    /// source: this is the replay buffer that makes resume lossless.
    pub replay_buffer_bytes: u32,
    /// Bytes received but not yet read by the local side, per stream direction.
    /// When full, the stream stops reading from QUIC (QUIC flow control then
    /// pushes back on the peer).
    pub recv_buffer_bytes: u32,
    /// Concurrent logical streams per edge.
    pub max_streams_per_edge: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 1024 * 1024,
            max_data_payload: 32 * 1024,
            max_head_bytes: 256 * 1024,
            replay_buffer_bytes: 2 * 1024 * 1024,
            recv_buffer_bytes: 1024 * 1024,
            max_streams_per_edge: 1024,
        }
    }
}

impl Limits {
    /// What this side uses on a link to a peer that announced `peer`: the
    /// smaller frame, data-payload and head bounds of the two (both sides
    /// compute the same), its own buffers and stream count. Consistent when
    /// both inputs are ([`Limits::validate`]).
    pub fn agree(&self, peer: &Limits) -> Limits {
        Limits {
            max_frame_bytes: self.max_frame_bytes.min(peer.max_frame_bytes),
            max_data_payload: self.max_data_payload.min(peer.max_data_payload),
            max_head_bytes: self.max_head_bytes.min(peer.max_head_bytes),
            ..*self
        }
    }

    /// [`Limits::agree`] with a peer's announced limits, checked: the agreed
    /// bounds must be consistent ([`Limits::validate`]), or this side could
    /// send no data (a payload of 0) or no frame the peer accepts (a payload
    /// or head that cannot fit in its frames). Our own limits were validated
    /// at start, so an error is the peer's: it names the peer's values.
    pub fn agree_checked(&self, peer: &Limits) -> Result<Limits, String> {
        let agreed = self.agree(peer);
        agreed.validate().map_err(|why| {
            format!(
                "the peer announced max-frame-bytes {}, max-data-payload {} and max-head-bytes {}; \
                 agreed with ours ({}, {}, {}) they are unusable: {why}",
                peer.max_frame_bytes,
                peer.max_data_payload,
                peer.max_head_bytes,
                self.max_frame_bytes,
                self.max_data_payload,
                self.max_head_bytes,
            )
        })?;
        Ok(agreed)
    }

    /// Checks that the bounds are consistent with each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_data_payload == 0
            || self.replay_buffer_bytes == 0
            || self.recv_buffer_bytes == 0
        {
            return Err(
                "max-data-payload, replay-buffer-bytes and recv-buffer-bytes must be positive"
                    .into(),
            );
        }
        if self.max_data_payload.saturating_add(64) > self.max_frame_bytes {
            return Err(format!(
                "max-data-payload ({}) plus framing must fit in max-frame-bytes ({})",
                self.max_data_payload, self.max_frame_bytes
            ));
        }
        if self.max_head_bytes.saturating_add(64) > self.max_frame_bytes {
            return Err(format!(
                "max-head-bytes ({}) plus framing must fit in max-frame-bytes ({})",
                self.max_head_bytes, self.max_frame_bytes
            ));
        }
        if self.max_streams_per_edge == 0 {
            return Err("max-streams-per-edge must be positive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreed_limits_are_the_smaller_bounds_and_stay_consistent() {
        let ours = Limits::default();
        let small = Limits {
            max_frame_bytes: 8192,
            max_data_payload: 4096,
            max_head_bytes: 4096,
            replay_buffer_bytes: 1,
            recv_buffer_bytes: 1,
            max_streams_per_edge: 1,
        };
        small.validate().unwrap();
        let a = ours.agree(&small);
        assert_eq!(
            (a.max_frame_bytes, a.max_data_payload, a.max_head_bytes),
            (8192, 4096, 4096)
        );
        // Buffers and stream count stay ours.
        assert_eq!(a.replay_buffer_bytes, ours.replay_buffer_bytes);
        assert_eq!(a.max_streams_per_edge, ours.max_streams_per_edge);
        a.validate().unwrap();
        // Both sides agree on the same wire bounds.
        let b = small.agree(&ours);
        assert_eq!(
            (b.max_frame_bytes, b.max_data_payload, b.max_head_bytes),
            (a.max_frame_bytes, a.max_data_payload, a.max_head_bytes)
        );
    }

    /// A peer's announced limits that would leave this side unable to send
    /// data (a payload of 0) or whose payload cannot fit in its frames are
    /// refused, naming the peer's values; consistent ones agree as before.
    #[test]
    fn unusable_announced_limits_are_refused_naming_the_peer_values() {
        let ours = Limits::default();
        let no_data = Limits {
            max_data_payload: 0,
            ..Limits::default()
        };
        let e = ours.agree_checked(&no_data).unwrap_err();
        assert!(e.contains("max-data-payload 0"), "{e}");
        assert!(e.contains("must be positive"), "{e}");
        // The payload plus framing does not fit in the peer's frames.
        let too_big = Limits {
            max_frame_bytes: 4096,
            max_data_payload: 4096,
            max_head_bytes: 1024,
            ..Limits::default()
        };
        let e = ours.agree_checked(&too_big).unwrap_err();
        assert!(e.contains("max-frame-bytes 4096"), "{e}");
        assert!(e.contains("must fit in max-frame-bytes (4096)"), "{e}");
        // A head bound the peer's frames cannot carry.
        let head = Limits {
            max_frame_bytes: 8192,
            max_data_payload: 1024,
            max_head_bytes: 8192,
            ..Limits::default()
        };
        assert!(ours
            .agree_checked(&head)
            .unwrap_err()
            .contains("max-head-bytes"));
        // A smaller but consistent peer agrees as `agree` does.
        let small = Limits {
            max_frame_bytes: 8192,
            max_data_payload: 4096,
            max_head_bytes: 4096,
            ..Limits::default()
        };
        assert_eq!(ours.agree_checked(&small), Ok(ours.agree(&small)));
    }

    #[test]
    fn defaults_are_consistent() {
        Limits::default().validate().unwrap();
    }

    #[test]
    fn payload_larger_than_frame_is_rejected() {
        let l = Limits {
            max_frame_bytes: 1000,
            max_data_payload: 1000,
            ..Limits::default()
        };
        assert!(l.validate().unwrap_err().contains("max-data-payload"));
    }
}
