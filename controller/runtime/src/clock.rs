//! The agent's only clock: every read of the time goes through here.
//!
//! Time is `tokio::time::Instant`, so `tokio::time::pause()` and `advance()` drive the
//! whole agent in tests. Wall-clock timestamps (what is persisted and shown) are derived
//! from it: a wall-clock base captured once, plus the tokio time elapsed since.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stead_schemas::Timestamp;
use tokio::time::Instant;

/// A source of `now`, cheap to clone.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall_base: Timestamp,
    instant_base: Instant,
}

impl Clock {
    /// The system clock, read once now; later readings advance with tokio's time.
    pub fn system() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Clock::starting_at(Timestamp::from_since_epoch(since_epoch))
    }

    /// A clock whose current time is `wall`; for tests, which want stable timestamps.
    pub fn starting_at(wall: Timestamp) -> Self {
        Clock {
            wall_base: wall,
            instant_base: Instant::now(),
        }
    }

    /// The current time.
    pub fn now(&self) -> Timestamp {
        self.wall_base + self.instant_base.elapsed()
    }

    /// The tokio instant at which the clock reads `at` (now, when `at` is in the past).
    pub fn instant_at(&self, at: Timestamp) -> Instant {
        let now = self.now();
        Instant::now() + at.saturating_duration_since(now)
    }

    /// The current tokio instant, for measuring spans of time.
    pub fn instant(&self) -> Instant {
        Instant::now()
    }

    /// The first instant at or after `at` on a grid of `grain` shared by every user of
    /// this clock: timers set on it fire together, `grain` at a time, rather than one by one.
    pub fn on_grid(&self, at: Instant, grain: Duration) -> Instant {
        let grain = grain.as_nanos().max(1);
        let offset = at.saturating_duration_since(self.instant_base).as_nanos();
        let rounded = offset.div_ceil(grain).saturating_mul(grain);
        let extra = u64::try_from(rounded - offset).unwrap_or(u64::MAX);
        at + Duration::from_nanos(extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn wall_time_advances_with_tokio_time() {
        let start = Timestamp::from_since_epoch(Duration::from_secs(1_000));
        let clock = Clock::starting_at(start);
        assert_eq!(clock.now(), start);
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(clock.now(), start + Duration::from_millis(1_500));
        let target = start + Duration::from_secs(10);
        tokio::time::sleep_until(clock.instant_at(target)).await;
        assert_eq!(clock.now(), target);
    }
}
