//! The HTTP endpoint of `run`: `/metrics` (OpenMetrics text), `/healthz` (liveness) and
//! `/readyz` (readiness), served by axum on the pipeline's runtime from the shared
//! [`Telemetry`]. The transport half of the metrics (a listening socket); the state it
//! reads is [`super`]'s.

use std::net::SocketAddr;
use std::sync::Arc;

use super::{Readiness, Telemetry};

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` on the current runtime
/// until the returned task is aborted.
///
/// # Errors
/// The bind error (address in use, not permitted).
pub async fn serve(
    addr: SocketAddr,
    telemetry: Arc<Telemetry>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr().unwrap_or(addr);
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .with_state(telemetry);
    tracing::info!(http_addr = %addr, "serving /metrics, /healthz and /readyz");
    Ok(tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(error = %error, "the metrics HTTP server stopped");
        }
    }))
}

type Shared = axum::extract::State<Arc<Telemetry>>;

async fn metrics_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        t.encode(),
    )
}

fn json_response(
    ok: bool,
    body: serde_json::Value,
) -> (
    axum::http::StatusCode,
    [(axum::http::HeaderName, &'static str); 1],
    String,
) {
    let status = if ok {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}

async fn healthz_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    let since = t.since_beat();
    let ok = t.is_healthy();
    json_response(
        ok,
        serde_json::json!({
            "status": if ok { "ok" } else { "unhealthy" },
            "reason": if ok { serde_json::Value::Null } else { "loop_not_turning".into() },
            "since_last_turn_ms": since.as_millis() as u64,
        }),
    )
}

async fn readyz_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    match t.readiness() {
        Readiness::Ready => json_response(true, serde_json::json!({ "status": "ready" })),
        Readiness::NotReady(reason) => json_response(
            false,
            serde_json::json!({
                "status": "not_ready",
                "reason": reason,
                "role": t.role().as_str(),
                "holder": t.holder(),
                "unconfirmed": t.unconfirmed(),
                "oldest_unconfirmed_age_s": t.oldest_unconfirmed_age(),
                "partitions_disconnected": t.disconnected(),
            }),
        ),
    }
}
