//! Which session a hello joins and which connection a session is attached to:
//! the admission rules, free of I/O.
//!
//! An edge's identity is its certificate (checked before anything here); what
//! a hello adds is a [`Claim`]: the resume token that names the edge's current
//! state (drawn by the edge, the same in every attempt of that state), and the
//! order of the attempt among the edge process's attempts. The rules:
//!
//! - a hello whose token is the session's **joins** it, however many attempts
//!   of the same state are in flight or were abandoned: nothing is spent when a
//!   hello is answered, so a slow, lost or raced welcome costs nothing;
//! - a hello with another token starts a **new session** that replaces the
//!   node's old one (the edge restarted or discarded its streams);
//! - a hello or commit from an attempt **older** than the connection attached
//!   now (same process, lower attempt number) is **superseded**: refused
//!   without touching the session, so an old connection never displaces a
//!   newer one;
//! - a session is attached only when the edge **commits** to the connection
//!   whose welcome it took ([`Gate::commit`]), so at most one connection per
//!   round of attempts is ever attached.
//!
//! [`Gate`] is the per-session state; [`judge`] decides for a node's current
//! session. `session.rs` and `registry.rs` apply the verdicts under their locks.

use tether_proto::token::ResumeToken;

/// What a hello says about the edge's state and the order of its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// Names the edge's current state (its open streams).
    pub token: ResumeToken,
    /// The edge process (random per start): attempt numbers of different
    /// processes are not comparable.
    pub instance: u64,
    /// The attempt's number within its process; only grows.
    pub attempt: u64,
}

impl Claim {
    pub fn of(hello: &tether_proto::handshake::Hello) -> Claim {
        Claim {
            token: hello.resume,
            instance: hello.instance,
            attempt: hello.attempt,
        }
    }
}

/// What to do with a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It continues the node's session: welcome it into that session.
    Join,
    /// It comes from another state of the edge: start a new session, which
    /// replaces (ends) the node's current one, if any.
    NewSession,
    /// It is older than the connection attached now: refuse it and leave the
    /// session alone.
    Superseded,
}

/// A commit that must not be attached: an attempt older than the attached
/// connection, or one of another state of the edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a newer connection of this edge is attached (or this attempt belongs to another session)")]
pub struct Superseded;

/// A session's admission state.
#[derive(Debug, Clone)]
pub struct Gate {
    token: ResumeToken,
    /// The process of the newest attached connection (or of the first hello).
    instance: u64,
    /// The attempt number of the newest attached connection of `instance`.
    newest: Option<u64>,
}

impl Gate {
    /// The gate of a session started by `claim`'s hello (nothing attached yet).
    pub fn new(claim: &Claim) -> Gate {
        Gate {
            token: claim.token,
            instance: claim.instance,
            newest: None,
        }
    }

    /// Whether `claim` names this session's state (constant-time compare).
    fn same_state(&self, claim: &Claim) -> bool {
        self.token
            .0
            .iter()
            .zip(claim.token.0.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }

    /// Whether `claim` is an attempt of the same process no newer than the
    /// attached connection.
    fn is_older(&self, claim: &Claim) -> bool {
        claim.instance == self.instance && self.newest.is_some_and(|n| claim.attempt <= n)
    }

    /// The verdict on a hello for this (live) session.
    pub fn judge(&self, claim: &Claim) -> Verdict {
        if self.is_older(claim) {
            Verdict::Superseded
        } else if self.same_state(claim) {
            Verdict::Join
        } else {
            Verdict::NewSession
        }
    }

    /// Whether `claim`'s connection may be attached now ([`Gate::commit`]
    /// without the update).
    pub fn may_commit(&self, claim: &Claim) -> Result<(), Superseded> {
        if self.is_older(claim) || !self.same_state(claim) {
            return Err(Superseded);
        }
        Ok(())
    }

    /// The edge committed to `claim`'s connection: it becomes the newest.
    pub fn commit(&mut self, claim: &Claim) -> Result<(), Superseded> {
        self.may_commit(claim)?;
        self.instance = claim.instance;
        self.newest = Some(claim.attempt);
        Ok(())
    }
}

/// The verdict on a hello for a node whose live session has `current`'s gate
/// (`None`: no session, or it ended).
pub fn judge(current: Option<&Gate>, claim: &Claim) -> Verdict {
    match current {
        Some(g) => g.judge(claim),
        None => Verdict::NewSession,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn claim(token: u8, instance: u64, attempt: u64) -> Claim {
        Claim {
            token: ResumeToken([token; 16]),
            instance,
            attempt,
        }
    }

    #[test]
    fn sibling_attempts_join_and_the_first_commit_wins_its_round() {
        // Attempts 1 and 2 of one state, hellos answered in either order.
        let mut g = Gate::new(&claim(1, 7, 2));
        assert_eq!(g.judge(&claim(1, 7, 1)), Verdict::Join);
        assert_eq!(g.judge(&claim(1, 7, 2)), Verdict::Join);
        // The edge took attempt 1's welcome.
        assert_eq!(g.commit(&claim(1, 7, 1)), Ok(()));
        // Attempt 2's hello, arriving late, is older than nothing: still
        // newer than 1, so it may join; but a repeat of 1 is superseded.
        assert_eq!(g.judge(&claim(1, 7, 2)), Verdict::Join);
        assert_eq!(g.judge(&claim(1, 7, 1)), Verdict::Superseded);
        assert_eq!(g.commit(&claim(1, 7, 1)), Err(Superseded));
    }

    #[test]
    fn an_older_connection_never_displaces_a_newer_one() {
        let mut g = Gate::new(&claim(1, 7, 5));
        g.commit(&claim(1, 7, 5)).unwrap();
        for a in 0..=5 {
            assert_eq!(g.judge(&claim(1, 7, a)), Verdict::Superseded);
            assert_eq!(g.may_commit(&claim(1, 7, a)), Err(Superseded));
            // Even one of an older state of the same process.
            assert_eq!(g.judge(&claim(2, 7, a)), Verdict::Superseded);
        }
        assert_eq!(g.commit(&claim(1, 7, 6)), Ok(()));
    }

    #[test]
    fn another_state_or_process_starts_a_new_session() {
        let mut g = Gate::new(&claim(1, 7, 1));
        g.commit(&claim(1, 7, 1)).unwrap();
        // The edge discarded its streams: new token, later attempt.
        assert_eq!(g.judge(&claim(2, 7, 9)), Verdict::NewSession);
        // A restarted edge: new process, its counter starts again.
        assert_eq!(g.judge(&claim(3, 8, 1)), Verdict::NewSession);
        // A commit of another state is never attached to this session.
        assert_eq!(g.commit(&claim(2, 7, 9)), Err(Superseded));
        assert_eq!(judge(None, &claim(1, 7, 1)), Verdict::NewSession);
    }

    /// What can happen to one attempt, in any interleaving.
    #[derive(Debug, Clone)]
    enum Event {
        /// The edge starts a new attempt (its next attempt number).
        Start,
        /// The cloud receives attempt `i`'s hello (if it was sent and the
        /// attempt is not yet answered).
        Hello(usize),
        /// Attempt `i`'s welcome reaches the edge.
        Welcome(usize),
        /// Attempt `i`'s commit reaches the cloud.
        Commit(usize),
        /// Attempt `i` is dropped (its timeout, or the link).
        Drop(usize),
        /// The attached connection dies (the edge starts a new round).
        ConnectionDies,
    }

    fn events() -> impl Strategy<Value = Vec<Event>> {
        prop::collection::vec(
            prop_oneof![
                2 => Just(Event::Start),
                3 => (0usize..12).prop_map(Event::Hello),
                3 => (0usize..12).prop_map(Event::Welcome),
                3 => (0usize..12).prop_map(Event::Commit),
                1 => (0usize..12).prop_map(Event::Drop),
                1 => Just(Event::ConnectionDies),
            ],
            1..80,
        )
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Phase {
        /// Hello in flight.
        Sent,
        /// The cloud answered (session id) with a welcome in flight.
        Welcomed(u32),
        /// Refused as superseded.
        Refused,
        /// The edge took this welcome and committed (in flight).
        Committing(u32),
        /// Attached, or refused at commit, or dropped: done.
        Done,
    }

    proptest! {
        /// Any interleaving of hellos, welcomes, commits and drops of one
        /// edge state (the edge never restarts here): the cloud never starts
        /// a second session, and the attached connection is always the
        /// newest one the edge committed to.
        #[test]
        fn one_edge_state_keeps_one_session(evs in events()) {
            let token = ResumeToken([5; 16]);
            // Cloud: sessions created (ids), the live one's gate, and the
            // attempt attached.
            let mut sessions = 0u32;
            let mut gate: Option<Gate> = None;
            let mut attached: Option<u64> = None;
            // Edge: its attempts (number, phase), whether a round is open.
            let mut attempts: Vec<(u64, Phase)> = Vec::new();
            let mut next_attempt = 1u64;
            let mut round_open = true;
            let mut edge_committed: Option<u64> = None;
            for ev in evs {
                match ev {
                    Event::Start if round_open => {
                        attempts.push((next_attempt, Phase::Sent));
                        next_attempt += 1;
                    }
                    Event::Start => {}
                    Event::Hello(i) => {
                        let Some((a, phase)) = attempts.get_mut(i) else { continue };
                        if *phase != Phase::Sent { continue }
                        let c = Claim { token, instance: 1, attempt: *a };
                        match judge(gate.as_ref(), &c) {
                            Verdict::Join => *phase = Phase::Welcomed(sessions),
                            Verdict::NewSession => {
                                sessions += 1;
                                gate = Some(Gate::new(&c));
                                attached = None;
                                *phase = Phase::Welcomed(sessions);
                            }
                            Verdict::Superseded => *phase = Phase::Refused,
                        }
                    }
                    Event::Welcome(i) => {
                        let Some((a, phase)) = attempts.get_mut(i) else { continue };
                        if let Phase::Welcomed(s) = *phase {
                            if round_open {
                                // The edge takes the first welcome of its
                                // round and drops the round's other attempts.
                                *phase = Phase::Committing(s);
                                edge_committed = Some(*a);
                                round_open = false;
                                let mine = *a;
                                for (b, p) in attempts.iter_mut() {
                                    if *b != mine && !matches!(p, Phase::Committing(_)) {
                                        *p = Phase::Done;
                                    }
                                }
                            } else {
                                *phase = Phase::Done;
                            }
                        }
                    }
                    Event::Commit(i) => {
                        let Some((a, phase)) = attempts.get_mut(i) else { continue };
                        if let Phase::Committing(_) = *phase {
                            let c = Claim { token, instance: 1, attempt: *a };
                            if let Some(g) = gate.as_mut() {
                                if g.commit(&c).is_ok() {
                                    attached = Some(*a);
                                }
                            }
                            *phase = Phase::Done;
                        }
                    }
                    Event::Drop(i) => {
                        if let Some((_, phase)) = attempts.get_mut(i) {
                            *phase = Phase::Done;
                        }
                    }
                    Event::ConnectionDies => {
                        // The edge's connection is gone: a new round starts.
                        round_open = true;
                    }
                }
                prop_assert!(sessions <= 1, "a second session was started");
                if let Some(a) = attached {
                    prop_assert!(edge_committed.is_some_and(|c| c >= a));
                }
            }
        }
    }
}
