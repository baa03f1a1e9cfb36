//! Turning a request body that was read within its limits into an endpoint's request type.
//!
//! Owns: [`parse_json_body`], the one JSON parse every HTTP endpoint makes of its body, with the
//! errors a client sees for an empty or malformed body.
//! Must not touch: reading the body off the connection (`request_body`) or what a request means
//! (each API's handlers).

use crate::error::GatewayError;
use crate::request_body::JsonRequestBody;

/// Parses a body read by [`JsonRequestBody`] as JSON, mapping every failure to a 4xx (or the
/// refusal the body's reading already decided).
pub fn parse_json_body<T: serde::de::DeserializeOwned>(
    body: JsonRequestBody,
) -> Result<T, GatewayError> {
    let bytes = body.0?;
    if bytes.is_empty() {
        return Err(GatewayError::invalid(
            "the request body is empty; a JSON object is expected",
        ));
    }
    serde_json::from_slice(&bytes).map_err(|error| {
        GatewayError::invalid(format!(
            "the request body is not valid JSON for this endpoint: {error}"
        ))
    })
}
