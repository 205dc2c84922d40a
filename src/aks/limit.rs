//! One client-side rate limit for every ARM call the operator makes, shared by all jobs.
//!
//! ARM throttles per subscription and identity (a token bucket of a few hundred requests,
//! refilled at 10–25 per second); a thousand jobs each looking at their pool would drain it,
//! and then every job would meet its own 429 and back off alone. So the operator spends its
//! own budget first ([`ArmLimit::admit`], a GCRA bucket from `governor`), and a 429 from ARM
//! holds *every* call back until its `Retry-After` has passed, not only the one that met it.
//!
//! A reconcile worker never waits long here: a call that would wait longer than
//! [`MAX_WAIT`] is not sent and comes back as [`Held`], which the controller treats like a
//! 429 (the job looks again later, nothing fails).

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

/// The longest a call waits for the budget before it is handed back to be retried later.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Requests per second the operator allows itself by default: under ARM's per-subscription
/// refill for writes (10/s) and well under its refill for reads, so the operator alone never
/// throttles the subscription other tools share.
pub const DEFAULT_REQUESTS_PER_SECOND: u32 = 10;

/// Why a call was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// When to try again.
    pub retry_after: Duration,
    /// ARM itself asked for the pause (an earlier 429), rather than the operator's own rate.
    pub by_arm: bool,
}

/// The shared limit; clones share one budget.
#[derive(Clone, Debug)]
pub struct ArmLimit {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    bucket: DefaultDirectRateLimiter,
    per_second: u32,
    /// No call goes out before this: the end of the last `Retry-After` ARM asked for.
    paused_until: Mutex<Option<Instant>>,
}

impl ArmLimit {
    /// `per_second` requests a second on average, in bursts of up to twice that.
    pub fn new(per_second: NonZeroU32) -> Self {
        let burst = per_second.saturating_mul(NonZeroU32::new(2).expect("2 is not zero"));
        Self {
            inner: Arc::new(Inner {
                bucket: RateLimiter::direct(Quota::per_second(per_second).allow_burst(burst)),
                per_second: per_second.get(),
                paused_until: Mutex::new(None),
            }),
        }
    }

    /// The configured rate, for messages.
    pub fn per_second(&self) -> u32 {
        self.inner.per_second
    }

    /// Takes one request from the budget, waiting at most [`MAX_WAIT`] for it.
    pub async fn admit(&self) -> Result<(), Held> {
        if let Some(left) = self.paused_for() {
            return Err(Held {
                retry_after: left,
                by_arm: true,
            });
        }
        match tokio::time::timeout(MAX_WAIT, self.inner.bucket.until_ready()).await {
            Ok(()) => Ok(()),
            Err(_) => Err(Held {
                retry_after: self.wait_for_budget().max(MAX_WAIT),
                by_arm: false,
            }),
        }
    }

    /// ARM answered 429: no call goes out for `retry_after` (a longer pause already asked
    /// for stays).
    pub fn pause(&self, retry_after: Duration) {
        let until = Instant::now() + retry_after;
        let mut paused = self.inner.paused_until.lock().expect("pause lock");
        if paused.is_none_or(|p| p < until) {
            *paused = Some(until);
        }
    }

    fn paused_for(&self) -> Option<Duration> {
        let paused = *self.inner.paused_until.lock().expect("pause lock");
        paused
            .map(|until| until.saturating_duration_since(Instant::now()))
            .filter(|left| !left.is_zero())
    }

    /// How long until the bucket has room again (without taking any).
    fn wait_for_budget(&self) -> Duration {
        let clock = DefaultClock::default();
        match self.inner.bucket.check() {
            // Room appeared meanwhile; it was taken, and one spent request is harmless.
            Ok(()) => Duration::ZERO,
            Err(not_until) => not_until.wait_time_from(clock.now()),
        }
    }
}

impl Default for ArmLimit {
    fn default() -> Self {
        Self::new(NonZeroU32::new(DEFAULT_REQUESTS_PER_SECOND).expect("not zero"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_burst_past_the_budget_is_handed_back_instead_of_waiting_long() {
        let limit = ArmLimit::new(NonZeroU32::new(2).unwrap());
        let started = Instant::now();
        // Ten jobs at once: the burst (4) goes at once, one or two more get the refill
        // (one each 0.5 s) within MAX_WAIT, and the rest come back to be retried.
        let results = futures::future::join_all((0..10).map(|_| limit.admit())).await;
        assert!(started.elapsed() < MAX_WAIT * 2, "{:?}", started.elapsed());
        let admitted = results.iter().filter(|r| r.is_ok()).count();
        assert!(
            (4..=6).contains(&admitted),
            "admitted {admitted}: {results:?}"
        );
        let held: Vec<Held> = results.into_iter().filter_map(Result::err).collect();
        assert!(
            held.iter().all(|h| !h.by_arm && h.retry_after >= MAX_WAIT),
            "{held:?}"
        );
    }

    #[tokio::test]
    async fn a_429_holds_back_every_call_until_its_retry_after() {
        let limit = ArmLimit::new(NonZeroU32::new(100).unwrap());
        let other_job = limit.clone();
        limit.pause(Duration::from_millis(300));
        let held = other_job.admit().await.unwrap_err();
        assert!(held.by_arm);
        assert!(held.retry_after <= Duration::from_millis(300));
        // A shorter pause asked for later does not shorten it.
        limit.pause(Duration::from_millis(10));
        assert!(other_job.admit().await.is_err());
        tokio::time::sleep(Duration::from_millis(320)).await;
        assert_eq!(other_job.admit().await, Ok(()));
    }
}
