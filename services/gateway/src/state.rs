//! What every handler shares while the gateway runs.
//!
//! Owns: [`GatewayState`] (the generator, the backend it schedules on, metrics, routing
//! statistics, settings) and [`GatewaySettings`].
//! Must not touch: routes, API shapes or generation logic; this module only holds them together.

use std::sync::Arc;

use crate::backend::GenerationBackend;
use crate::chat::NonTextContent;
use crate::generation::{Generator, ModelAliases};
use crate::image_urls::ImageUrlPolicy;
use crate::metrics::GatewayMetrics;
use crate::routing_stats::RoutingStatsHandle;

/// Settings that do not change while the gateway runs.
#[derive(Clone, Debug)]
pub struct GatewaySettings {
    /// When set, every API route needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Other names clients may use for served models (`sonnet`, `claude-*`).
    pub model_aliases: ModelAliases,
    /// Images and documents sent to the text-only model: a placeholder, or a 400.
    pub non_text_content: NonTextContent,
    /// The `http(s)` image URLs fetched (`None`, the default: none).
    pub image_urls: Option<Arc<ImageUrlPolicy>>,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            api_key: None,
            max_body_bytes: 8 * 1024 * 1024,
            model_aliases: ModelAliases::default(),
            non_text_content: NonTextContent::default(),
            image_urls: None,
        }
    }
}

/// Shared by every handler.
pub struct GatewayState {
    pub backend: Arc<dyn GenerationBackend>,
    /// Every API generates through this one.
    pub generator: Generator,
    pub metrics: Arc<GatewayMetrics>,
    pub routing_stats: Option<RoutingStatsHandle>,
    pub settings: GatewaySettings,
}

impl GatewayState {
    pub fn new(
        backend: Arc<dyn GenerationBackend>,
        routing_stats: Option<RoutingStatsHandle>,
        settings: GatewaySettings,
    ) -> Arc<Self> {
        let metrics = Arc::new(GatewayMetrics::default());
        Arc::new(GatewayState {
            generator: Generator::new(
                backend.clone(),
                metrics.clone(),
                settings.model_aliases.clone(),
            ),
            backend,
            metrics,
            routing_stats,
            settings,
        })
    }
}
