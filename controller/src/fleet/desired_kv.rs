//! The desired loop's seam to etcd: a listing of a prefix at one revision and a watch
//! from a start revision, no more. Two implementations: etcd's client, here, and the
//! simulator's in-memory etcd (`tests/tests/scenarios/sim_fleet.rs`), which models
//! revisions, compaction and disconnects.

use std::future::Future;

use etcd_client::{Client, EventType, GetOptions, WatchOptions, WatchResponse, WatchStream};

/// What the desired loop reads from etcd.
pub trait DesiredKv: Send + Sync + 'static {
    /// The stream a watch answers with.
    type Watch: DesiredWatch;

    /// Every key below `prefix` at `revision` (the newest when `None`), with the
    /// revision of the store the answer was read at. A revision below the compacted one
    /// fails.
    fn list(
        &self,
        prefix: &str,
        revision: Option<i64>,
    ) -> impl Future<Output = Result<KeyListing, etcd_client::Error>> + Send;

    /// Watches every key below `prefix` from `start_revision` on, with progress notices.
    fn watch(
        &self,
        prefix: &str,
        start_revision: i64,
    ) -> impl Future<Output = Result<Self::Watch, etcd_client::Error>> + Send;
}

/// One watch's answers.
pub trait DesiredWatch: Send {
    /// The next message; `None` when the stream ended.
    fn message(
        &mut self,
    ) -> impl Future<Output = Result<Option<WatchMessage>, etcd_client::Error>> + Send;
}

/// A listing: the keys with their values, as read at `revision`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyListing {
    /// The store's revision the listing was read at (0 when etcd named none).
    pub revision: i64,
    /// Every key with its value, in key order.
    pub kvs: Vec<KeyValue>,
}

/// One key and its value, as etcd holds them (bytes, not necessarily UTF-8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// Its value (empty for a deletion).
    pub value: Vec<u8>,
}

/// One change a watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// A put or a delete.
    pub kind: EventType,
    /// The key, with its new value (empty for a delete).
    pub kv: KeyValue,
    /// The revision of the change.
    pub mod_revision: i64,
}

/// One answer on a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMessage {
    /// The watch is created. `revision` is the store's when it was: the catch-up's
    /// events (older than it) are still to come, so it vouches for nothing.
    Created {
        /// The header's revision.
        revision: i64,
    },
    /// Changes, in revision order; the events of one revision are never split over two
    /// messages.
    Events(Vec<WatchEvent>),
    /// The watch has caught up: every event up to the store's `revision` has been sent.
    Progress {
        /// The header's revision.
        revision: i64,
    },
    /// The start revision was compacted: history is kept from `revision` on only.
    Compacted {
        /// The compacted revision.
        revision: i64,
    },
    /// etcd ended the watch.
    Canceled {
        /// Why, as etcd said it.
        reason: String,
    },
}

impl WatchMessage {
    /// What one of etcd's watch responses says.
    fn from_response(response: &WatchResponse) -> Self {
        if response.compact_revision() > 0 {
            return WatchMessage::Compacted {
                revision: response.compact_revision(),
            };
        }
        if response.canceled() {
            return WatchMessage::Canceled {
                reason: response.cancel_reason().to_owned(),
            };
        }
        let header = response.header().map(|header| header.revision());
        if response.events().is_empty() {
            if response.created() {
                return WatchMessage::Created {
                    revision: header.unwrap_or(0),
                };
            }
            if let Some(revision) = header {
                return WatchMessage::Progress { revision };
            }
        }
        WatchMessage::Events(
            response
                .events()
                .iter()
                .filter_map(|event| {
                    let kv = event.kv()?;
                    Some(WatchEvent {
                        kind: event.event_type(),
                        kv: KeyValue {
                            key: kv.key().to_vec(),
                            value: kv.value().to_vec(),
                        },
                        mod_revision: kv.mod_revision(),
                    })
                })
                .collect(),
        )
    }
}

impl DesiredKv for Client {
    type Watch = WatchStream;

    async fn list(
        &self,
        prefix: &str,
        revision: Option<i64>,
    ) -> Result<KeyListing, etcd_client::Error> {
        let mut options = GetOptions::new().with_prefix();
        if let Some(revision) = revision {
            options = options.with_revision(revision);
        }
        let answer = self.kv_client().get(prefix, Some(options)).await?;
        Ok(KeyListing {
            revision: answer.header().map_or(0, |header| header.revision()),
            kvs: answer
                .kvs()
                .iter()
                .map(|kv| KeyValue {
                    key: kv.key().to_vec(),
                    value: kv.value().to_vec(),
                })
                .collect(),
        })
    }

    async fn watch(
        &self,
        prefix: &str,
        start_revision: i64,
    ) -> Result<WatchStream, etcd_client::Error> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(start_revision)
            .with_progress_notify();
        self.watch_client().watch(prefix, Some(options)).await
    }
}

impl DesiredWatch for WatchStream {
    async fn message(&mut self) -> Result<Option<WatchMessage>, etcd_client::Error> {
        let response = WatchStream::message(self).await?;
        Ok(response.as_ref().map(WatchMessage::from_response))
    }
}
