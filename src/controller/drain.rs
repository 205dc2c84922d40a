//! Reads a watch on a task of its own, so that the API server never waits for a reconcile.
//!
//! The API server closes a watch whose reader falls behind. Its watch cache gives each new
//! watch a buffer of about one second of events: the cache's capacity over its 75 s history,
//! at least 10 (k8s.io/apiserver `watch_cache.go`, `suggestedWatchChannelSize`). On a cluster
//! that was quiet when the watch opened the capacity is 100, so the buffer is 10 events, and
//! the cache waits at most about 100 ms for a full one before it closes the watch
//! (`apiserver_terminated_watchers_total`).
//!
//! kube-runtime reads a controller's watches on the controller's own task, between the
//! reconciles it polls there, so a burst of reconciles also delays reading. Here the watch is
//! read, decoded and cached on a task that does nothing else, and its events wait for the
//! controller in an unbounded queue of the operator's own memory, where a burst costs a few
//! stripped pods. Measured at 1,000 jobs of 8 workers on a 2-core cluster (issue 41), this did
//! not change how often the API server closed the pod watch (about 20 times in a run's first
//! 30 s, as before): there the API server itself could not keep up. It keeps the operator from
//! ever being the slow reader.

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;

/// Polls `stream` to its end on a task of its own and yields its items in order. The task
/// stops when the stream ends or when what this returns is dropped.
///
/// The items wait in an unbounded queue: what is read is never held back from the reader,
/// which is the point (see the module's comment). Pass a stream whose items are small (cached
/// pods are stripped first) and whose reader keeps up on average.
pub fn drained<S>(stream: S) -> impl Stream<Item = S::Item> + Send + 'static
where
    S: Stream + Send + 'static,
    S::Item: Send + 'static,
{
    let (sender, mut receiver) = mpsc::unbounded_channel();
    tokio::spawn(forward(stream, sender));
    futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
}

/// Sends `stream`'s items until it ends or nobody receives them.
async fn forward<S>(stream: S, sender: mpsc::UnboundedSender<S::Item>)
where
    S: Stream,
{
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            // A quiet watch would otherwise keep the task (and its connection) after its
            // controller has stopped.
            () = sender.closed() => return,
            item = stream.next() => {
                let Some(item) = item else { return };
                if sender.send(item).is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use futures::StreamExt;

    use super::drained;

    /// A stream of `0..n` that counts what has been read from it.
    fn counted(n: usize) -> (impl futures::Stream<Item = usize> + Send, Arc<AtomicUsize>) {
        let read = Arc::new(AtomicUsize::new(0));
        let counter = read.clone();
        let stream = futures::stream::iter(0..n).inspect(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        (stream, read)
    }

    async fn wait_until(what: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !what() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the drain task did not get there in 10 s");
    }

    #[tokio::test]
    async fn the_watch_is_read_to_its_end_while_nobody_takes_its_events() {
        let (stream, read) = counted(10_000);
        let events = drained(stream);
        // The consumer is busy elsewhere: it has not polled once.
        wait_until(|| read.load(Ordering::SeqCst) == 10_000).await;
        let received: Vec<usize> = events.collect().await;
        assert_eq!(
            received,
            (0..10_000).collect::<Vec<_>>(),
            "all of them, in order"
        );
    }

    /// Drains `stream` (which holds `dropped`'s sender), drops the receiving end, and waits
    /// for the task to drop the stream: the watch it stands for is closed then.
    async fn assert_stream_dropped_with_receiver<S>(
        stream: S,
        dropped: tokio::sync::oneshot::Receiver<()>,
    ) where
        S: futures::Stream + Send + 'static,
        S::Item: Send + 'static,
    {
        let events = drained(stream);
        tokio::task::yield_now().await;
        drop(events);
        let closed = tokio::time::timeout(Duration::from_secs(10), dropped).await;
        assert!(
            matches!(closed, Ok(Err(_))),
            "the task kept its stream after the receiver was dropped"
        );
    }

    #[tokio::test]
    async fn the_task_stops_reading_when_its_events_are_no_longer_wanted() {
        // An endless watch, one event each millisecond.
        let (sender, dropped) = tokio::sync::oneshot::channel::<()>();
        let endless = futures::stream::unfold(sender, |sender| async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Some(((), sender))
        });
        assert_stream_dropped_with_receiver(endless, dropped).await;
    }

    #[tokio::test]
    async fn a_quiet_watch_is_closed_when_its_events_are_no_longer_wanted() {
        // No event ever comes: only the receiver's drop can end the task.
        let (sender, dropped) = tokio::sync::oneshot::channel::<()>();
        let quiet = futures::stream::pending::<()>().map(move |item| {
            let _held_until_the_stream_is_dropped = &sender;
            item
        });
        assert_stream_dropped_with_receiver(quiet, dropped).await;
    }
}
