//! A stream written as an async block: the block hands each item to whoever polls the stream,
//! in that poller's task, with no task or channel between them.
//!
//! Owns: [`InlineStream`] and its [`Emitter`]. Why: an answer's tokens used to pass through a
//! spawned task and a channel per stage (engine stream → generation → API events → HTTP body),
//! which woke a task per stage for every token; with one token arriving at a time that hand-off
//! was most of the gateway's work per token. Here the HTTP connection's task polls the whole
//! chain itself, and dropping the stream (the client went away) drops the block and everything
//! it holds, which cancels the generation on the engine.
//! Must not touch: what the items are (each API's producer decides).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures_util::Stream;

/// The one item on its way from the block to the poller.
type Slot<T> = Arc<Mutex<Option<T>>>;

/// Items produced by an async block, polled in the consumer's task (see the module doc).
pub struct InlineStream<T> {
    /// `None` once the block has returned.
    body: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    slot: Slot<T>,
}

/// The block's handle for handing out items.
pub struct Emitter<T> {
    slot: Slot<T>,
}

impl<T: Send + 'static> InlineStream<T> {
    /// The stream of what `body` sends through its [`Emitter`]; it ends when `body` returns.
    pub fn new<Body, Produced>(body: Body) -> Self
    where
        Body: FnOnce(Emitter<T>) -> Produced,
        Produced: Future<Output = ()> + Send + 'static,
    {
        let slot: Slot<T> = Arc::new(Mutex::new(None));
        let emitter = Emitter { slot: slot.clone() };
        InlineStream {
            body: Some(Box::pin(body(emitter))),
            slot,
        }
    }
}

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(PoisonError::into_inner).take()
}

impl<T> Stream for InlineStream<T> {
    type Item = T;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<T>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(None);
        };
        // The block runs until it hands over an item (its send then waits for the next poll)
        // or waits on something else, which wakes this poller's task.
        let finished = body.as_mut().poll(context).is_ready();
        if finished {
            self.body = None;
        }
        match take(&self.slot) {
            Some(item) => Poll::Ready(Some(item)),
            None if finished => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

impl<T> Emitter<T> {
    /// Hands `item` to the poller; returns once the poller has taken it and asks for the next
    /// one. A poller that never asks again drops the stream, and with it the waiting block.
    pub fn send(&self, item: T) -> impl Future<Output = ()> + '_ {
        Handing {
            slot: &self.slot,
            item: Some(item),
        }
    }
}

/// [`Emitter::send`]'s future: puts the item in the slot, then waits until it is gone.
struct Handing<'a, T> {
    slot: &'a Mutex<Option<T>>,
    item: Option<T>,
}

impl<T> Unpin for Handing<'_, T> {}

impl<T> Future for Handing<'_, T> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, _context: &mut Context<'_>) -> Poll<()> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            // The previous item is still there: only a second send running alongside this
            // one could have put it, and the poller takes it before polling the block again.
            return Poll::Pending;
        }
        match self.item.take() {
            Some(item) => {
                *slot = Some(item);
                // No wake-up needed: the poller finds the item as soon as the block yields.
                Poll::Pending
            }
            None => Poll::Ready(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn items_arrive_in_order_and_the_stream_ends_with_the_block() {
        let stream = InlineStream::new(|emitter| async move {
            for item in 0..5u32 {
                emitter.send(item).await;
                tokio::task::yield_now().await;
            }
        });
        assert_eq!(stream.collect::<Vec<_>>().await, vec![0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn the_block_runs_only_as_far_as_the_poller_asks() {
        let progress = Arc::new(AtomicUsize::new(0));
        let seen = progress.clone();
        let mut stream = InlineStream::new(move |emitter| async move {
            for item in 0..10usize {
                seen.store(item, Ordering::SeqCst);
                emitter.send(item).await;
            }
        });
        assert_eq!(stream.next().await, Some(0));
        assert_eq!(stream.next().await, Some(1));
        assert_eq!(progress.load(Ordering::SeqCst), 1);
        // Dropping the stream drops the block and what it holds.
        drop(stream);
        assert_eq!(Arc::strong_count(&progress), 1);
    }

    #[tokio::test]
    async fn a_block_waiting_on_a_channel_wakes_the_poller() {
        let (sender, mut receiver) = tokio::sync::mpsc::channel::<u32>(1);
        let stream = InlineStream::new(|emitter| async move {
            while let Some(item) = receiver.recv().await {
                emitter.send(item * 10).await;
            }
        });
        let feeder = tokio::spawn(async move {
            for item in 1..4 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                if sender.send(item).await.is_err() {
                    return;
                }
            }
        });
        assert_eq!(stream.collect::<Vec<_>>().await, vec![10, 20, 30]);
        assert!(feeder.await.is_ok());
    }
}
