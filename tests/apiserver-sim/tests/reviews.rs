//! TokenReview and SubjectAccessReview as a kubelet's webhook calls them, posted
//! with real kubectl (`create --raw`): known and unknown tokens, rules by user
//! and group, the API's validation errors, the review counter, and a stalled
//! apiserver (`--review-delay-ms`).

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::*;

const T: Duration = Duration::from_secs(30);

const AUTH: &str = r#"{
  "tokens": [
    {"token": "ms-token", "username": "system:serviceaccount:kube-system:metrics-server",
     "uid": "u-1", "groups": ["system:serviceaccounts", "system:authenticated"]},
    {"token": "nobody-token", "username": "nobody", "groups": ["system:authenticated"]}
  ],
  "rules": [
    {"name": "metrics-server", "user": "system:serviceaccount:kube-system:metrics-server",
     "verbs": ["get"], "resources": ["nodes/metrics", "nodes/stats"]},
    {"name": "prometheus", "group": "monitoring", "verbs": ["get"], "resources": ["nodes/proxy"]}
  ]
}"#;

async fn post(api: &Apiserver, path: &str, obj: &Value) -> KubectlRun {
    let file = api.home.path().join("review.json");
    std::fs::write(&file, obj.to_string()).unwrap();
    api.kubectl(
        KUBECTL_133,
        &["create", "--raw", path, "-f", file.to_str().unwrap()],
        T,
    )
    .await
}

fn parsed(run: &KubectlRun) -> Value {
    assert!(run.success, "{run:?}");
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {}", run.stdout))
}

fn token_review(token: &str) -> Value {
    json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
           "spec": {"token": token, "audiences": ["https://kubernetes.default.svc"]}})
}

fn access_review(user: &str, groups: &[&str], verb: &str, sub: &str) -> Value {
    json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
           "spec": {"user": user, "groups": groups,
                    "resourceAttributes": {"verb": verb, "resource": "nodes",
                                           "subresource": sub, "name": "edge-1"}}})
}

const TR: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
const SAR: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

#[tokio::test]
async fn token_and_access_reviews_answer_like_the_apiserver() {
    let pki = pki();
    let auth = pki.dir.path().join("auth.json");
    std::fs::write(&auth, AUTH).unwrap();
    let api = Apiserver::start(&pki, &["--auth-file".into(), auth.display().to_string()]).await;

    let v = parsed(&post(&api, TR, &token_review("ms-token")).await);
    assert_eq!(v["kind"], "TokenReview");
    assert_eq!(v["status"]["authenticated"], true, "{v}");
    assert_eq!(
        v["status"]["user"]["username"],
        "system:serviceaccount:kube-system:metrics-server"
    );
    assert_eq!(v["status"]["user"]["groups"][0], "system:serviceaccounts");
    assert_eq!(
        v["status"]["audiences"][0],
        "https://kubernetes.default.svc"
    );

    let v = parsed(&post(&api, TR, &token_review("forged")).await);
    assert!(v["status"].get("authenticated").is_none(), "{v}");
    assert!(
        v["status"]["error"]
            .as_str()
            .unwrap()
            .contains("invalid bearer token"),
        "{v}"
    );

    let run = post(&api, TR, &token_review("")).await;
    assert!(!run.success);
    assert!(run.stderr.contains("token is required"), "{}", run.stderr);

    let ms = "system:serviceaccount:kube-system:metrics-server";
    let v = parsed(&post(&api, SAR, &access_review(ms, &[], "get", "metrics")).await);
    assert_eq!(v["status"]["allowed"], true, "{v}");
    assert!(
        v["status"]["reason"]
            .as_str()
            .unwrap()
            .contains("metrics-server"),
        "{v}"
    );
    for (verb, sub) in [("create", "metrics"), ("get", "proxy"), ("get", "log")] {
        let v = parsed(&post(&api, SAR, &access_review(ms, &[], verb, sub)).await);
        assert_eq!(v["status"]["allowed"], false, "{verb} {sub}: {v}");
    }
    let v = parsed(
        &post(
            &api,
            SAR,
            &access_review("prom", &["monitoring"], "get", "proxy"),
        )
        .await,
    );
    assert_eq!(v["status"]["allowed"], true, "{v}");
    let v = parsed(&post(&api, SAR, &access_review("nobody", &[], "get", "proxy")).await);
    assert_eq!(v["status"]["allowed"], false, "{v}");

    let mut neither = access_review(ms, &[], "get", "metrics");
    neither["spec"]
        .as_object_mut()
        .unwrap()
        .remove("resourceAttributes");
    let run = post(&api, SAR, &neither).await;
    assert!(!run.success);
    assert!(run.stderr.contains("exactly one of"), "{}", run.stderr);
    let run = post(&api, SAR, &access_review("", &[], "get", "metrics")).await;
    assert!(!run.success);
    assert!(
        run.stderr.contains("at least one of user or group"),
        "{}",
        run.stderr
    );

    let run = api
        .kubectl(KUBECTL_133, &["get", "--raw", "/sim/reviews"], T)
        .await;
    let counts = parsed(&run);
    assert_eq!(counts["tokenReviews"], 3, "{counts}");
    assert_eq!(counts["subjectAccessReviews"], 8, "{counts}");
}

#[tokio::test]
async fn review_delay_stalls_every_answer() {
    let pki = pki();
    let api = Apiserver::start(&pki, &["--review-delay-ms".into(), "1500".into()]).await;
    let started = Instant::now();
    let v = parsed(&post(&api, TR, &token_review("x")).await);
    assert!(v["status"]["error"].is_string(), "{v}");
    assert!(started.elapsed() >= Duration::from_millis(1500));
}
