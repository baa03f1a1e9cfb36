//! What the files of this suite share: a scripted engine and a gateway in front of it.

use std::sync::Arc;

use crate::common::*;

pub async fn start() -> (RunningEngine, RunningGateway) {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}
