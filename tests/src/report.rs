//! Running named test cases concurrently, each under its own time bound, and reporting:
//! one line per case as it finishes (`PASS`/`FAIL`, its duration, the error), and a
//! summary per kubectl version such as `kubectl 1.28: 12 passed, 0 failed`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::Semaphore;

/// A case's body.
pub type CaseFuture = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// A named case.
pub struct Case {
    pub name: &'static str,
    pub body: CaseFuture,
}

impl Case {
    /// A case from a name and a future.
    pub fn new(
        name: &'static str,
        body: impl Future<Output = Result<()>> + Send + 'static,
    ) -> Case {
        Case {
            name,
            body: Box::pin(body),
        }
    }
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// The kubectl version (or other group) the case ran for.
    pub group: String,
    pub name: &'static str,
    pub elapsed: Duration,
    /// `None` when it passed.
    pub error: Option<String>,
}

impl CaseResult {
    /// Whether it passed.
    pub fn passed(&self) -> bool {
        self.error.is_none()
    }
}

/// Runs `cases` for `group`, at most `parallel` at a time, each bounded by `limit`, and
/// prints a line per case when it ends.
pub async fn run_cases(
    group: &str,
    cases: Vec<Case>,
    parallel: usize,
    limit: Duration,
) -> Vec<CaseResult> {
    let gate = Arc::new(Semaphore::new(parallel.max(1)));
    let mut handles = Vec::new();
    for case in cases {
        let gate = gate.clone();
        let group = group.to_string();
        handles.push((
            case.name,
            tokio::spawn(async move {
                let _permit = gate.acquire_owned().await;
                let start = Instant::now();
                let error = match tokio::time::timeout(limit, case.body).await {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(format!("{e:#}")),
                    Err(_) => Some(format!("timed out after {limit:?}")),
                };
                let r = CaseResult {
                    group,
                    name: case.name,
                    elapsed: start.elapsed(),
                    error,
                };
                print_result(&r);
                r
            }),
        ));
    }
    let mut results = Vec::new();
    for (name, h) in handles {
        results.push(match h.await {
            Ok(r) => r,
            Err(e) => CaseResult {
                group: group.to_string(),
                name,
                elapsed: Duration::ZERO,
                error: Some(format!("case task failed: {e}")),
            },
        });
    }
    results
}

fn print_result(r: &CaseResult) {
    match &r.error {
        None => println!(
            "[kubectl {}] PASS {} ({:.1}s)",
            r.group,
            r.name,
            r.elapsed.as_secs_f64()
        ),
        Some(e) => println!(
            "[kubectl {}] FAIL {} ({:.1}s): {e}",
            r.group,
            r.name,
            r.elapsed.as_secs_f64()
        ),
    }
}

/// The summary line of one group: `kubectl 1.28: 12 passed, 0 failed`.
pub fn summary_line(group: &str, results: &[CaseResult]) -> String {
    let mine: Vec<&CaseResult> = results.iter().filter(|r| r.group == group).collect();
    let passed = mine.iter().filter(|r| r.passed()).count();
    format!(
        "kubectl {group}: {passed} passed, {} failed",
        mine.len() - passed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counts_and_bounds() {
        let cases = vec![
            Case::new("ok", async { Ok(()) }),
            Case::new("bad", async { anyhow::bail!("nope") }),
            Case::new("slow", async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            }),
        ];
        let r = run_cases("9.99", cases, 3, Duration::from_millis(200)).await;
        assert_eq!(summary_line("9.99", &r), "kubectl 9.99: 1 passed, 2 failed");
        assert!(r[2]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("timed out")));
    }
}
