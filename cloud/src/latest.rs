//! The latest value of something, and a wake-up for the tasks waiting for it
//! to change: what `tokio::sync::watch` does, at a third of its size.
//!
//! Two live per connected edge: its session's link and its address as the
//! migration sweep sees it. A `watch` channel is a separate allocation of
//! about 350 bytes (eight `Notify`s, spread to cut contention among many
//! receivers), where these have a few waiters (a session's open streams, the
//! edge's migration watch) and change only when the edge connects, moves or
//! goes. This keeps the value, a version and one `Notify` inline in the
//! owner.

use std::ops::Deref;
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

/// A value, its version (bumped at every change) and the waiters' wake-up.
pub struct Latest<T> {
    state: Mutex<(T, u64)>,
    changed: Notify,
}

/// A borrow of the value (the lock is held while it lives: keep it short,
/// and never change the value through its [`Latest`] meanwhile).
pub struct Ref<'a, T>(MutexGuard<'a, (T, u64)>);

impl<T> Deref for Ref<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0 .0
    }
}

impl<T> Latest<T> {
    pub fn new(value: T) -> Self {
        Latest {
            state: Mutex::new((value, 0)),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (T, u64)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn borrow(&self) -> Ref<'_, T> {
        Ref(self.lock())
    }

    /// The value, marking its version as seen by the caller.
    pub fn borrow_and_update(&self, seen: &mut u64) -> Ref<'_, T> {
        let g = self.lock();
        *seen = g.1;
        Ref(g)
    }

    /// The version now (what a new waiter has seen).
    pub fn version(&self) -> u64 {
        self.lock().1
    }

    /// Lets `modify` change the value; when it says it did, the version goes
    /// up and every waiter wakes. Returns what `modify` said.
    pub fn send_if_modified(&self, modify: impl FnOnce(&mut T) -> bool) -> bool {
        let mut g = self.lock();
        if !modify(&mut g.0) {
            return false;
        }
        g.1 += 1;
        drop(g);
        self.changed.notify_waiters();
        true
    }

    /// Replaces the value (always a change); returns the old one.
    pub fn send_replace(&self, value: T) -> T {
        let mut g = self.lock();
        let old = std::mem::replace(&mut g.0, value);
        g.1 += 1;
        drop(g);
        self.changed.notify_waiters();
        old
    }

    /// Waits until the version differs from `seen`.
    pub async fn changed(&self, seen: u64) {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the version is read: a change between the
            // two still wakes it.
            notified.as_mut().enable();
            if self.version() != seen {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_waiter_wakes_on_a_change_and_only_then() {
        let l = Arc::new(Latest::new(1u32));
        let mut seen = 0;
        assert_eq!(*l.borrow_and_update(&mut seen), 1);
        // No change: still waiting.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), l.changed(seen))
                .await
                .is_err()
        );
        // "Not modified" is no change either.
        assert!(!l.send_if_modified(|_| false));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), l.changed(seen))
                .await
                .is_err()
        );
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move {
                l.changed(seen).await;
                *l.borrow()
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(l.send_if_modified(|v| {
            *v = 2;
            true
        }));
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the change")
            .unwrap();
        assert_eq!(got, 2);
        // A change made before the wait began is not missed.
        assert_eq!(l.send_replace(3), 2);
        tokio::time::timeout(Duration::from_secs(5), l.changed(seen))
            .await
            .expect("a change since `seen` completes at once");
        assert_eq!(*l.borrow_and_update(&mut seen), 3);
        assert_eq!(seen, l.version());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_changes_never_strand_a_waiter() {
        let l = Arc::new(Latest::new(0u64));
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move {
                let mut seen = 0;
                loop {
                    if *l.borrow_and_update(&mut seen) == 1000 {
                        return;
                    }
                    l.changed(seen).await;
                }
            })
        };
        for i in 1..=1000u64 {
            l.send_replace(i);
            if i % 100 == 0 {
                tokio::task::yield_now().await;
            }
        }
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter saw the last value")
            .unwrap();
    }
}
