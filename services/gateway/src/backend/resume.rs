//! Resuming a generation whose engine went away mid-answer (killed, crashed or restarted).
//!
//! Owns: what a generation keeps to continue elsewhere (its request and the tokens already
//! passed on), the continuation request — the prompt followed by those tokens, marked as the
//! generation's own output (the engine moves the reasoning block and the grammar past them), the
//! rest of the token budget, the seeded random stream advanced past the draws they used — and
//! [`ResumeCounters`]. Greedy continuations are exactly the uninterrupted text, and so are
//! seeded sampled ones of requests that do not speculate (a speculating engine draws for its
//! drafts too: the continuation then follows the same distribution, not the same draws).
//! Must not touch: picking or watching engines (`engine_pool` does, through the closures it
//! passes), HTTP or API shapes.

use std::sync::atomic::{AtomicU64, Ordering};

use ninfer_protocol::v1::{FinishReason, GenerateRequest, GeneratedToken};

/// Streams resumed after their engine went away, and resumptions that gave up.
#[derive(Debug, Default)]
pub struct ResumeCounters {
    pub resumed: AtomicU64,
    pub abandoned: AtomicU64,
}

/// A snapshot of [`ResumeCounters`] for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResumeCounts {
    pub resumed: u64,
    pub abandoned: u64,
}

impl ResumeCounters {
    pub fn counts(&self) -> ResumeCounts {
        ResumeCounts {
            resumed: self.resumed.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
        }
    }
}

/// One generation as far as it got: the request it started with and every token passed on.
#[derive(Debug, Clone)]
pub struct GenerationProgress {
    original: GenerateRequest,
    received: Vec<u32>,
    resumptions: u32,
    /// Tokens generated before the continuation now running (its prompt holds them).
    carried: u32,
}

impl GenerationProgress {
    pub fn new(original: GenerateRequest) -> Self {
        GenerationProgress {
            original,
            received: Vec::new(),
            resumptions: 0,
            carried: 0,
        }
    }

    pub fn model_name(&self) -> &str {
        &self.original.model_name
    }

    pub fn request_id(&self) -> &str {
        &self.original.request_id
    }

    pub fn tokens_received(&self) -> usize {
        self.received.len()
    }

    /// Records a token about to be passed on and, for a token of a continuation, rewrites its
    /// usage figures to the whole generation's (the continuation's prompt holds the tokens
    /// generated before it).
    pub fn record(&mut self, mut token: GeneratedToken) -> GeneratedToken {
        let carried = self.carried;
        if token.finish_reason != FinishReason::Cancelled as i32 {
            self.received.push(token.token_id);
        }
        if carried > 0 {
            token.prompt_tokens = token.prompt_tokens.saturating_sub(carried);
            token.completion_tokens = token.completion_tokens.saturating_add(carried);
            token.cached_prompt_tokens = token.cached_prompt_tokens.min(token.prompt_tokens);
        }
        token
    }

    /// The request that continues this generation on another engine (the engine moves its
    /// reasoning block and grammar past the tokens already produced), or `None` when nothing
    /// is left of its token budget.
    pub fn continuation(&mut self) -> Option<GenerateRequest> {
        let original = &self.original;
        let received = &self.received;
        let generated = u32::try_from(received.len()).ok()?;
        let max_new_tokens = original.max_new_tokens.checked_sub(generated)?;
        if max_new_tokens == 0 {
            return None;
        }
        let mut next = original.clone();
        next.request_id = format!("{}-resumed-{}", original.request_id, self.resumptions + 1);
        next.prompt_token_ids.extend_from_slice(received);
        next.max_new_tokens = max_new_tokens;
        next.resumed_output_tokens = generated;
        if let Some(sampling) = next.sampling.as_mut() {
            // One draw per sampled token (greedy draws none).
            if sampling.temperature > 0.0 {
                sampling.random_stream_position += u64::from(generated);
            }
        }
        self.resumptions += 1;
        self.carried = generated;
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_protocol::v1::SamplingParameters;

    fn request(temperature: f32) -> GenerateRequest {
        GenerateRequest {
            request_id: "r".into(),
            prompt_token_ids: vec![1, 2, 3],
            max_new_tokens: 10,
            sampling: Some(SamplingParameters {
                temperature,
                seed: Some(9),
                ..Default::default()
            }),
            model_name: "m".into(),
            ..Default::default()
        }
    }

    fn token(id: u32, prompt: u32, completion: u32) -> GeneratedToken {
        GeneratedToken {
            token_id: id,
            prompt_tokens: prompt,
            completion_tokens: completion,
            ..Default::default()
        }
    }

    #[test]
    fn a_continuation_carries_the_sent_tokens_the_rest_of_the_budget_and_the_stream_position() {
        let mut progress = GenerationProgress::new(request(0.7));
        progress.record(token(40, 3, 1));
        progress.record(token(41, 3, 2));
        let next = progress.continuation().unwrap_or_default();
        assert_eq!(next.prompt_token_ids, vec![1, 2, 3, 40, 41]);
        assert_eq!(next.max_new_tokens, 8);
        assert_eq!(next.request_id, "r-resumed-1");
        assert_eq!(next.resumed_output_tokens, 2);
        let sampling = next.sampling.unwrap_or_default();
        assert_eq!(
            (sampling.seed, sampling.random_stream_position),
            (Some(9), 2)
        );
        // The continuation's usage reads as the whole generation's.
        let third = progress.record(token(42, 5, 1));
        assert_eq!((third.prompt_tokens, third.completion_tokens), (3, 3));
        let again = progress.continuation().unwrap_or_default();
        assert_eq!(again.prompt_token_ids, vec![1, 2, 3, 40, 41, 42]);
        assert_eq!(again.resumed_output_tokens, 3);
        assert_eq!(again.sampling.unwrap_or_default().random_stream_position, 3);
        // Greedy draws nothing.
        let mut greedy = GenerationProgress::new(request(0.0));
        greedy.record(token(40, 3, 1));
        let next = greedy.continuation().unwrap_or_default();
        assert_eq!(next.sampling.unwrap_or_default().random_stream_position, 0);
        // Nothing left to generate: nothing to continue.
        let mut spent = GenerationProgress::new(GenerateRequest {
            max_new_tokens: 1,
            ..request(0.0)
        });
        spent.record(token(40, 3, 1));
        assert!(spent.continuation().is_none());
    }
}
