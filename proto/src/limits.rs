//! Every bound the protocol enforces, with its default.
//!
//! Both ends carry a [`Limits`] and announce it (edge in the hello, cloud in
//! the welcome); each side then sends with [`Limits::agree`]: frames and data
//! payloads no bigger than *both* accept, so neither ever sends a frame the
//! other would reject. Buffers and stream counts stay each side's own. Each field is a
//! configuration key of both binaries (same name, `--kebab-case` flag).

use serde::{Deserialize, Serialize};

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
