//! A response body polled through only when something woke it since it last said it had
//! nothing.
//!
//! Owns: [`WokenBody`]. Why: hyper's HTTP/1 connection polls a streaming body three times per
//! event it writes (the event, then twice more after the flush, both finding nothing), and a
//! streaming answer's body is a deep chain (the API's events, the generation, the engine's
//! gRPC stream down to its HTTP/2 buffer, which takes a lock): the last of those polls walked
//! the whole chain for nothing, once per generated token. Here the chain is polled with this
//! body's own waker, which notes that it was woken before it wakes the task; a poll that
//! follows a `Pending` with no wake-up in between answers `Pending` at once.
//! Must not touch: what the body carries.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};

/// What the inner body's wake-ups reach: a flag, then the task's waker.
#[derive(Default)]
struct WakeNote {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for WakeNote {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// `inner`, polled only when it may have something new (see the module doc).
pub struct WokenBody<B> {
    inner: B,
    note: Arc<WakeNote>,
    /// The waker the inner body is polled with (made once: wakers registered further down
    /// then see the same one at every poll and are not replaced).
    waker: Waker,
    /// The last poll of `inner` answered `Pending`.
    idle: bool,
}

impl<B> WokenBody<B> {
    pub fn new(inner: B) -> Self {
        let note = Arc::new(WakeNote::default());
        WokenBody {
            inner,
            waker: Waker::from(note.clone()),
            note,
            idle: false,
        }
    }
}

impl<B: Body + Unpin> Body for WokenBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        // Registered before the flag is read: a wake-up after the read reaches this task.
        this.note.task.register(context.waker());
        // Cleared before the inner poll, so a wake-up during it is kept for the next poll.
        let woken = this.note.woken.swap(false, Ordering::AcqRel);
        if this.idle && !woken {
            return Poll::Pending;
        }
        let mut own = Context::from_waker(&this.waker);
        let polled = Pin::new(&mut this.inner).poll_frame(&mut own);
        this.idle = polled.is_pending();
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// A body that counts its polls and hands out what `pending` holds, keeping the last waker.
    #[derive(Clone, Default)]
    struct Probe {
        polls: Arc<AtomicUsize>,
        pending: Arc<Mutex<Vec<&'static str>>>,
        waker: Arc<Mutex<Option<Waker>>>,
    }

    impl Body for Probe {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            context: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if pending.is_empty() {
                *self.waker.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(context.waker().clone());
                return Poll::Pending;
            }
            let item = pending.remove(0);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(item.as_bytes())))))
        }
    }

    /// Counts the wake-ups of the task polling the body.
    #[derive(Default)]
    struct TaskWakes(AtomicUsize);

    impl Wake for TaskWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll(body: &mut WokenBody<Probe>, waker: &Waker) -> Poll<Option<Bytes>> {
        let mut context = Context::from_waker(waker);
        Pin::new(body)
            .poll_frame(&mut context)
            .map(|frame| frame.and_then(|frame| frame.ok()?.into_data().ok()))
    }

    #[test]
    fn a_poll_after_pending_reaches_the_inner_body_only_once_woken() {
        let probe = Probe::default();
        let task = Arc::new(TaskWakes::default());
        let waker = Waker::from(task.clone());
        let mut body = WokenBody::new(probe.clone());
        assert!(poll(&mut body, &waker).is_pending());
        assert!(poll(&mut body, &waker).is_pending());
        assert!(poll(&mut body, &waker).is_pending());
        assert_eq!(
            probe.polls.load(Ordering::SeqCst),
            1,
            "unwoken polls stop here"
        );

        probe
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push("one");
        let inner_waker = probe.waker.lock().unwrap_or_else(|e| e.into_inner()).take();
        inner_waker.expect("the inner body kept a waker").wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert_eq!(
            poll(&mut body, &waker),
            Poll::Ready(Some(Bytes::from("one")))
        );
        // After an item the body is asked again at once: more may be there.
        assert!(poll(&mut body, &waker).is_pending());
        assert!(poll(&mut body, &waker).is_pending());
        assert_eq!(probe.polls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_wake_up_during_the_inner_poll_is_not_lost() {
        // The inner body wakes its waker while answering Pending (as a spent cooperative
        // budget does): the next poll must reach it.
        struct WakesItself(usize);
        impl Body for WakesItself {
            type Data = Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                context: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
                self.0 += 1;
                if self.0 < 3 {
                    context.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Ready(None)
            }
        }
        let task = Arc::new(TaskWakes::default());
        let waker = Waker::from(task.clone());
        let mut body = WokenBody::new(WakesItself(0));
        let mut context = Context::from_waker(&waker);
        assert!(Pin::new(&mut body).poll_frame(&mut context).is_pending());
        assert!(Pin::new(&mut body).poll_frame(&mut context).is_pending());
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut context),
            Poll::Ready(None)
        ));
        assert_eq!(task.0.load(Ordering::SeqCst), 2);
    }
}
