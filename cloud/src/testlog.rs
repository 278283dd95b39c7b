//! Test support: the warnings a piece of code logs, captured so a test can
//! count them and check what they name.

use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Collects every WARN event as one line: its fields as `name=value`.
struct Capture(Arc<Mutex<Vec<String>>>);

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            let mut line = Line(String::new());
            event.record(&mut line);
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(line.0);
        }
    }
}

/// Runs `f` on this thread and returns its result with the warnings it logged.
pub fn warnings<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Capture(lines.clone()));
    let r = tracing::subscriber::with_default(subscriber, f);
    let lines = lines.lock().unwrap_or_else(|p| p.into_inner()).clone();
    (r, lines)
}
