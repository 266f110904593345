//! The `driver` host interface: sessions with native driver libraries
//! (`include/kvplane_driver.h`, loaded by `kvplane-driver`).
//!
//! A plugin may open only the drivers its declaration names. Driver calls
//! block, so they run on tokio's blocking pool with the buffers' memory
//! locked for the duration; the plugin call's deadline is passed to the
//! driver and also bounds the wait here. A driver call that outlives the
//! deadline keeps its session and buffers locked until it returns: the
//! session then answers `unavailable` rather than run two calls at once,
//! and the memory is never reused under the driver.

use std::sync::{Arc, Mutex};

use wasmtime::component::Resource;

use super::bindings::kvplane::plugin::driver;
use super::bindings::kvplane::plugin::types::{Busy, CallOptions, Error};
use super::buffer::{BlockBuffer, DestinationGuard};
use super::host::{HandleKind, HostState};
use kvplane_driver::{Driver, Options, Session, Status};

/// One open driver session, owned by the plugin instance's resource table.
// `pub` although only this crate reaches it: the bindings (`with:`)
// re-export it as the `driver.session` resource with a `pub use`, which a
// `pub(crate)` type cannot be.
#[allow(unreachable_pub)]
pub struct DriverSession {
    name: String,
    session: Arc<Mutex<Session>>,
}

impl std::fmt::Debug for DriverSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverSession").field("name", &self.name).finish()
    }
}

fn to_error(driver: &str, index: usize, status: Status) -> Error {
    let what = |kind: &str| format!("driver {driver}: entry #{index}: {kind}");
    match status {
        Status::NotFound => Error::NotFound,
        Status::Timeout => Error::Timeout(what("timed out")),
        Status::Unavailable => Error::Unavailable(what("store unavailable")),
        Status::Invalid => Error::Invalid(what("invalid key or option")),
        Status::Capacity { len } => {
            Error::Capacity(what(&format!("value of {len} bytes does not fit its destination, or the store is full")))
        }
        Status::Internal => Error::Internal(what("driver fault")),
        Status::Unsupported => Error::Unsupported(what("not supported by the store")),
        Status::Busy { retry_after_ms } => Error::Busy(Busy { retry_after_ms, message: what("store busy") }),
        Status::Denied => Error::Denied(what("refused by the store")),
        Status::Unknown(code) => Error::Internal(what(&format!("status code {code} is not in kvplane_driver.h"))),
    }
}

impl HostState {
    fn driver_options(&self, options: &CallOptions) -> Options {
        let timeout_ms =
            self.deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()).as_millis().max(1) as u64).unwrap_or(0);
        Options { ttl_ms: options.ttl_ms, namespace: options.namespace.clone(), timeout_ms }
    }

    fn loaded_driver(&self, name: &str) -> Result<Arc<Driver>, Error> {
        let decl = &self.shared.decl;
        let Some(path) = decl.drivers.get(name) else {
            return Err(Error::Denied(format!(
                "driver {name:?} is not in plugin {}'s declared drivers {:?}",
                decl.name,
                decl.drivers.keys().collect::<Vec<_>>()
            )));
        };
        let mut loaded = self.shared.drivers.lock().map_err(|_| Error::Internal("driver table poisoned".into()))?;
        if let Some(d) = loaded.get(name) {
            return Ok(d.clone());
        }
        let d = Driver::load(path).map_err(|e| Error::Unavailable(format!("driver {name}: {e}")))?;
        loaded.insert(name.to_owned(), d.clone());
        Ok(d)
    }

    /// Run `f` on the session on the blocking pool, until the deadline.
    async fn on_session<T: Send + 'static>(
        &mut self,
        session: &Resource<DriverSession>,
        f: impl FnOnce(&mut Session) -> T + Send + 'static,
    ) -> wasmtime::Result<Result<T, Error>> {
        let s = self.table.get(session)?;
        let (name, shared) = (s.name.clone(), s.session.clone());
        let work = tokio::task::spawn_blocking(move || {
            // A session is used by one call at a time; one still running
            // after its deadline makes later calls fail fast.
            let mut guard = match shared.try_lock() {
                Ok(g) => g,
                Err(_) => return None,
            };
            Some(f(&mut guard))
        });
        let result = match self.deadline {
            Some(d) => match tokio::time::timeout_at(d, work).await {
                Ok(r) => r,
                Err(_) => return Ok(Err(Error::Timeout(format!("driver {name}: the plugin call's deadline passed")))),
            },
            None => work.await,
        };
        Ok(match result {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(Error::Unavailable(format!("driver {name}: the session is still busy with a call that ran past its deadline"))),
            Err(e) => Err(Error::Internal(format!("driver {name}: the call panicked: {e}"))),
        })
    }
}

/// The driver's answer, one per entry, in the contract's terms; a failure of
/// the call as a whole (deadline, busy session) answers every entry.
fn per_entry<T>(driver: &str, n: usize, answer: Result<Vec<Result<T, Status>>, Error>) -> Vec<Result<T, Error>> {
    match answer {
        Ok(r) => r.into_iter().enumerate().map(|(i, r)| r.map_err(|s| to_error(driver, i, s))).collect(),
        Err(e) => (0..n).map(|_| Err(e.clone())).collect(),
    }
}

/// Lock the destinations of a `get`, once per region, and cut each into the
/// views asked for. Views of one region must not overlap (two keys written
/// into the same bytes); views that do are refused.
async fn lock_views(views: Vec<BlockBuffer>) -> Result<(Vec<DestinationGuard>, Vec<(usize, usize, usize)>), Error> {
    // (region index, offset in region, len) per view.
    let mut regions: Vec<(Arc<super::buffer::Region>, DestinationGuard)> = Vec::new();
    let mut placed = Vec::with_capacity(views.len());
    for view in &views {
        let found = regions.iter().position(|(r, _)| Arc::ptr_eq(r, view.region()));
        let at = match found {
            Some(i) => i,
            None => {
                let whole = BlockBuffer::whole(view.region().clone());
                regions.push((view.region().clone(), whole.lock_destination().await?));
                regions.len() - 1
            }
        };
        placed.push((at, view.offset(), view.len()));
    }
    let mut sorted: Vec<&(usize, usize, usize)> = placed.iter().collect();
    sorted.sort();
    for w in sorted.windows(2) {
        if w[0].0 == w[1].0 && w[0].1 + w[0].2 > w[1].1 {
            return Err(Error::Invalid("two destinations of one get overlap".into()));
        }
    }
    Ok((regions.into_iter().map(|(_, g)| g).collect(), placed))
}

/// Cut locked regions into the disjoint `&mut` views of `placed`, in order.
fn carve<'a>(guards: &'a mut [DestinationGuard], placed: &[(usize, usize, usize)]) -> Vec<&'a mut [u8]> {
    // Per region, its views sorted by offset, split off front to back.
    let mut out: Vec<Option<&'a mut [u8]>> = (0..placed.len()).map(|_| None).collect();
    for (r, guard) in guards.iter_mut().enumerate() {
        let mut mine: Vec<(usize, usize, usize)> =
            placed.iter().enumerate().filter(|(_, p)| p.0 == r).map(|(i, p)| (p.1, p.2, i)).collect();
        mine.sort();
        let mut rest: &'a mut [u8] = guard.whole_mut();
        let mut consumed = 0;
        for (offset, len, i) in mine {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - consumed);
            let (view, tail) = tail.split_at_mut(len);
            out[i] = Some(view);
            rest = tail;
            consumed = offset + len;
        }
    }
    out.into_iter().map(|v| v.expect("every view belongs to a locked region")).collect()
}

impl driver::Host for HostState {}

impl driver::HostSession for HostState {
    async fn open(&mut self, name: String, config: Vec<(String, String)>) -> wasmtime::Result<Result<Resource<DriverSession>, Error>> {
        let d = match self.loaded_driver(&name) {
            Ok(d) => d,
            Err(e) => return Ok(Err(e)),
        };
        if let Err(e) = self.check_limit("handles", u64::from(self.usage.handles), 1, u64::from(self.shared.decl.limits.handles)) {
            self.handles_exhausted = true;
            return Ok(Err(e));
        }
        let opened = match tokio::task::spawn_blocking(move || d.open(&config)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Ok(Err(Error::Unavailable(format!("driver {name}: {e}")))),
            Err(e) => return Ok(Err(Error::Internal(format!("driver {name}: open panicked: {e}")))),
        };
        if let Err(e) = self.admit(HandleKind::Session) {
            return Ok(Err(e));
        }
        Ok(Ok(self.table.push(DriverSession { name, session: Arc::new(Mutex::new(opened)) })?))
    }

    async fn put(
        &mut self,
        session: Resource<DriverSession>,
        entries: Vec<(Vec<u8>, Resource<BlockBuffer>)>,
        options: CallOptions,
    ) -> wasmtime::Result<Vec<Result<(), Error>>> {
        let n = entries.len();
        let mut keys = Vec::with_capacity(n);
        let mut values = Vec::with_capacity(n);
        for (key, buffer) in entries {
            match self.table.get(&buffer)?.source_bytes() {
                Ok(b) => values.push(b),
                Err(e) => return Ok((0..n).map(|_| Err(e.clone())).collect()),
            }
            keys.push(key);
        }
        let opts = self.driver_options(&options);
        let name = self.table.get(&session)?.name.clone();
        let answer = self
            .on_session(&session, move |s| {
                let k: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                let v: Vec<&[u8]> = values.iter().map(|b| &b[..]).collect();
                s.put(&k, &v, &opts)
            })
            .await?;
        Ok(per_entry(&name, n, answer))
    }

    async fn get(
        &mut self,
        session: Resource<DriverSession>,
        entries: Vec<(Vec<u8>, Resource<BlockBuffer>)>,
        options: CallOptions,
    ) -> wasmtime::Result<Vec<Result<u64, Error>>> {
        let n = entries.len();
        let mut keys = Vec::with_capacity(n);
        let mut views = Vec::with_capacity(n);
        for (key, buffer) in entries {
            let b = self.table.get(&buffer)?;
            views.push(b.slice(0, b.len() as u64).expect("a view's whole range is inside it"));
            keys.push(key);
        }
        let (mut guards, placed) = match lock_views(views).await {
            Ok(g) => g,
            Err(e) => return Ok((0..n).map(|_| Err(e.clone())).collect()),
        };
        let opts = self.driver_options(&options);
        let name = self.table.get(&session)?.name.clone();
        let answer = self
            .on_session(&session, move |s| {
                let k: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                let mut dest = carve(&mut guards, &placed);
                s.get(&k, &mut dest, &opts).into_iter().map(|r| r.map(|len| len as u64)).collect::<Vec<_>>()
            })
            .await?;
        Ok(per_entry(&name, n, answer))
    }

    async fn exists(
        &mut self,
        session: Resource<DriverSession>,
        keys: Vec<Vec<u8>>,
        options: CallOptions,
    ) -> wasmtime::Result<Vec<Result<bool, Error>>> {
        let n = keys.len();
        let opts = self.driver_options(&options);
        let name = self.table.get(&session)?.name.clone();
        let answer = self
            .on_session(&session, move |s| {
                let k: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                s.exists(&k, &opts)
            })
            .await?;
        Ok(per_entry(&name, n, answer))
    }

    async fn delete(
        &mut self,
        session: Resource<DriverSession>,
        keys: Vec<Vec<u8>>,
        options: CallOptions,
    ) -> wasmtime::Result<Vec<Result<(), Error>>> {
        let n = keys.len();
        let opts = self.driver_options(&options);
        let name = self.table.get(&session)?.name.clone();
        let answer = self
            .on_session(&session, move |s| {
                let k: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                s.delete(&k, &opts)
            })
            .await?;
        Ok(per_entry(&name, n, answer))
    }

    async fn drop(&mut self, session: Resource<DriverSession>) -> wasmtime::Result<()> {
        self.table.delete(session)?;
        self.release(HandleKind::Session);
        Ok(())
    }
}
