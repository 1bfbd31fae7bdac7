//! Connections: the server accepts and serves its TCP connections itself
//! (hyper's HTTP/1.1 server with a timer) rather than through
//! `axum::serve`, which gives hyper no timer, so that no read of a client
//! was ever bounded: idle connections held descriptors for ever (1 100 of
//! them at a 1 024-descriptor limit locked every client out) and clients
//! trickling headers kept a SIGTERMed server alive indefinitely. Here:
//!
//! - a request head must be complete within `header_timeout` of the
//!   connection opening or of its previous answer (hyper's header-read
//!   timeout): a slowloris client is cut off;
//! - a connection with no request in flight and no byte of a next one is
//!   closed after `keep_alive_timeout`;
//! - a body must arrive within `body_timeout` of its head (enforced where
//!   the body is read, `crate::http::read_body`);
//! - at most `max_connections` are open. At the cap a new connection
//!   closes the oldest one with no request in flight (idle or still
//!   sending its head); when every one has a request in flight, the new one
//!   is answered 503 and closed. Descriptors therefore never run out, and a
//!   flood of idle connections cannot lock real clients out;
//! - on shutdown the listener closes, connections without a request in
//!   flight close at once, and requests in flight get `drain_timeout` to
//!   finish before their connections are closed too.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::metrics::Metrics;

/// How long clients may take, and how many connections may be open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request head must be complete this long after the connection
    /// opened or its previous answer was sent.
    pub header_timeout: Duration,
    /// A request body must have arrived this long after its head.
    pub body_timeout: Duration,
    /// A connection with no request in flight and no byte of a next one is
    /// closed after this.
    pub keep_alive_timeout: Duration,
    /// Most connections open at once; keep it below the process's
    /// descriptor limit.
    pub max_connections: usize,
    /// On shutdown, how long requests in flight get to finish.
    pub drain_timeout: Duration,
}

/// Descriptors a server keeps for itself beyond its connections: the
/// model's files, the runtime's, stdio, a refused connection's.
const RESERVED_DESCRIPTORS: u64 = 64;
/// The default connection cap where descriptors do not bound it.
const DEFAULT_MAX_CONNECTIONS: u64 = 65_536;

impl ConnectionLimits {
    /// The connection cap: `asked`, or by default what this process's
    /// descriptor limit leaves room for; refused when the limit cannot hold
    /// it.
    pub fn connection_cap(asked: Option<usize>) -> crate::Result<usize> {
        let limit = descriptor_limit();
        let room = limit.map_or(DEFAULT_MAX_CONNECTIONS, |l| {
            l.saturating_sub(RESERVED_DESCRIPTORS)
        });
        let raise = |l: u64| {
            format!(
                "this process may open {l} descriptors and the server keeps {RESERVED_DESCRIPTORS} of them for itself; raise the limit (ulimit -n)"
            )
        };
        let refuse = |why: String| Err(crate::Error::Options(why));
        match (asked, limit) {
            (Some(0), _) => refuse("--max-connections must be ≥ 1".into()),
            (Some(n), Some(l)) if n as u64 > room => refuse(format!(
                "--max-connections {n} does not fit: {}, or lower --max-connections to {room}",
                raise(l)
            )),
            (Some(n), _) => Ok(n),
            (None, Some(l)) if room == 0 => {
                refuse(format!("no room for connections: {}", raise(l)))
            }
            (None, _) => Ok(room.min(DEFAULT_MAX_CONNECTIONS) as usize),
        }
    }
}

/// This process's open-file limit (the soft one, which is what `accept`
/// runs into), if it has one.
fn descriptor_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct it is given, which we own.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        (read && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
    }
    #[cfg(not(unix))]
    None
}

/// Why a connection closed, as `qforge_connections_closed_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// The client closed it, or it ended after an answer (`Connection:
    /// close`, an error the server answered).
    Done,
    /// The request head did not arrive within the header timeout.
    HeaderTimeout,
    /// Idle beyond the keep-alive timeout.
    IdleTimeout,
    /// Closed to make room for a new connection at the cap.
    Evicted,
    /// Refused at the cap: every open connection had a request in flight.
    Refused,
    /// Closed on shutdown with no request in flight.
    Shutdown,
    /// Still answering when the drain deadline passed.
    DrainDeadline,
    /// The connection failed (a reset, a malformed request hyper refused).
    Error,
}

impl Closed {
    fn label(self) -> &'static str {
        match self {
            Closed::Done => "done",
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::Evicted => "evicted",
            Closed::Refused => "refused",
            Closed::Shutdown => "shutdown",
            Closed::DrainDeadline => "drain_deadline",
            Closed::Error => "error",
        }
    }
}

/// What the accept loop, the connection's task, its service and its
/// socket share about one connection.
#[derive(Default)]
struct Link {
    /// Requests whose answer is not yet fully written.
    in_flight: AtomicUsize,
    /// Answers written so far: each one starts a new idle period.
    answered: AtomicU64,
    /// The idle timer closed the connection.
    idle_expired: AtomicBool,
    /// Asked to close at the cap (and not yet closed).
    evicting: AtomicBool,
    /// Wakes the connection's task to close for a newcomer.
    evict: Notify,
    /// Hears that the connection has closed.
    closed: Notify,
}

impl Link {
    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
    }

    /// One request in flight until the returned guard drops (with the
    /// last frame of its answer, or when hyper gives up on it).
    fn begin(self: &Arc<Self>) -> Answering {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Answering(Arc::clone(self))
    }
}

struct Answering(Arc<Link>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.answered.fetch_add(1, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The open connections, oldest first.
#[derive(Default)]
struct Links {
    open: Mutex<BTreeMap<u64, Arc<Link>>>,
    next: AtomicU64,
}

impl Links {
    fn len(&self) -> usize {
        self.open.lock().expect("connections lock").len()
    }

    fn insert(&self) -> (u64, Arc<Link>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let link = Arc::new(Link::default());
        self.open
            .lock()
            .expect("connections lock")
            .insert(id, Arc::clone(&link));
        (id, link)
    }

    fn remove(&self, id: u64) {
        self.open.lock().expect("connections lock").remove(&id);
    }

    /// Asks the oldest connection with no request in flight to close, and
    /// gives it; `None` when every connection has one in flight.
    fn evict_oldest_idle(&self) -> Option<Arc<Link>> {
        let open = self.open.lock().expect("connections lock");
        let link = open
            .values()
            .find(|l| !l.busy() && !l.evicting.swap(true, Ordering::SeqCst))?;
        link.evict.notify_one();
        Some(Arc::clone(link))
    }
}

/// The socket of a connection, closing it once it has been idle (no
/// request in flight, no byte of a next one) for the keep-alive timeout.
/// The check sits in the read because hyper reads exactly while it waits
/// for a next request.
struct Watched {
    stream: TcpStream,
    link: Arc<Link>,
    keep_alive: Duration,
    idle: Pin<Box<Sleep>>,
    /// `link.answered` when the current idle period began.
    seen: u64,
    /// Some byte arrived since the current idle period began: the request
    /// head is on its way, and the header timeout governs.
    heard: bool,
}

impl Watched {
    fn new(stream: TcpStream, link: Arc<Link>, keep_alive: Duration) -> Self {
        Self {
            stream,
            link,
            keep_alive,
            idle: Box::pin(tokio::time::sleep(keep_alive)),
            seen: 0,
            heard: false,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        if let Poll::Ready(read) = Pin::new(&mut this.stream).poll_read(cx, buf) {
            this.heard |= buf.filled().len() > before;
            return Poll::Ready(read);
        }
        let answered = this.link.answered.load(Ordering::SeqCst);
        if answered != this.seen {
            this.seen = answered;
            this.heard = false;
            let deadline = Instant::now() + this.keep_alive;
            this.idle.as_mut().reset(deadline);
        }
        if !this.heard && !this.link.busy() && this.idle.as_mut().poll(cx).is_ready() {
            this.link.idle_expired.store(true, Ordering::SeqCst);
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "idle beyond the keep-alive timeout",
            )));
        }
        Poll::Pending
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// An answer's body, holding its request in flight until hyper has
/// written (or dropped) it: a streamed completion is in flight until its
/// last event, not just until its headers.
struct Tracked {
    body: Body,
    _answering: Answering,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The answer to a connection beyond the cap when none can be closed for
/// it.
fn refusal(max_connections: usize) -> Vec<u8> {
    let body = format!(
        "{{\"error\": \"all {max_connections} connections this server takes have a request in flight; retry shortly\"}}"
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Accepts and serves connections on `listener` until `shutdown`
/// completes, then drains them (see the module doc).
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let links = Arc::new(Links::default());
    let (stopping, stop) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        // Finished connections leave the set here, so it holds only open ones.
        while tasks.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                accept_failed(&e, &links).await;
                continue;
            }
        };
        if links.len() >= limits.max_connections {
            match links.evict_oldest_idle() {
                // Wait for its descriptor before taking another.
                Some(evicted) => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), evicted.closed.notified())
                        .await;
                }
                None => {
                    // One attempt, no waiting (a client that reads
                    // nothing costs nothing): it gets the 503 if its socket
                    // takes it.
                    let _ = stream.try_write(&refusal(limits.max_connections));
                    metrics.connection_closed(Closed::Refused.label());
                    continue;
                }
            }
        }
        let (id, link) = links.insert();
        metrics.open_connections.inc();
        let connection = Connection {
            id,
            link,
            links: Arc::clone(&links),
            metrics: Arc::clone(&metrics),
        };
        tasks.spawn(connection.serve(stream, app.clone(), limits, stop.clone()));
    }
    drop(listener);
    let _ = stopping.send(true);
    let drained = tokio::time::timeout(limits.drain_timeout, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        let cut = tasks.len();
        tracing::warn!(
            "qforge serve: {cut} connection(s) still answering after the {} ms drain; closing them",
            limits.drain_timeout.as_millis()
        );
        for _ in 0..cut {
            metrics.connection_closed(Closed::DrainDeadline.label());
        }
        tasks.shutdown().await;
    }
}

/// After a failed accept: a connection that died in the backlog is
/// nothing, but out of descriptors (or memory) the pending connection
/// stays queued and the listener stays readable, so free an idle
/// connection and pause rather than spin.
async fn accept_failed(error: &io::Error, links: &Links) {
    if matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    ) {
        return;
    }
    tracing::warn!("qforge serve: accepting a connection failed: {error}");
    links.evict_oldest_idle();
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// One open connection's bookkeeping; dropping it (however its task
/// ends, aborted included) takes the connection off the books.
struct Connection {
    id: u64,
    link: Arc<Link>,
    links: Arc<Links>,
    metrics: Arc<Metrics>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.links.remove(self.id);
        self.metrics.open_connections.dec();
        self.link.closed.notify_one();
    }
}

impl Connection {
    async fn serve(
        self,
        stream: TcpStream,
        app: Router,
        limits: ConnectionLimits,
        mut stop: watch::Receiver<bool>,
    ) {
        let link = Arc::clone(&self.link);
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let answering = link.begin();
            let mut app = app.clone();
            async move {
                let response = match app.call(request.map(Body::new)).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|body| Tracked {
                    body,
                    _answering: answering,
                }))
            }
        });
        let io = TokioIo::new(Watched::new(
            stream,
            Arc::clone(&self.link),
            limits.keep_alive_timeout,
        ));
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout);
        let mut connection = pin!(http.serve_connection(io, service));
        let mut draining = false;
        let closed = loop {
            tokio::select! {
                result = connection.as_mut() => break self.outcome(result),
                () = self.link.evict.notified() => {
                    if !self.link.busy() {
                        break Closed::Evicted;
                    }
                    // A request arrived since it was picked: it stays.
                    self.link.evicting.store(false, Ordering::SeqCst);
                }
                _ = stop.wait_for(|&stop| stop), if !draining => {
                    if !self.link.busy() {
                        break Closed::Shutdown;
                    }
                    // Finish the answer in flight, then close.
                    connection.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
        };
        self.metrics.connection_closed(closed.label());
    }

    fn outcome(&self, result: Result<(), hyper::Error>) -> Closed {
        match result {
            // hyper takes a failed read between requests for the client's
            // close, so the idle timer's own flag says it was the timer.
            _ if self.link.idle_expired.load(Ordering::SeqCst) => Closed::IdleTimeout,
            Ok(()) => Closed::Done,
            Err(e) if e.is_timeout() => Closed::HeaderTimeout,
            Err(e) if e.is_incomplete_message() || e.is_canceled() => Closed::Done,
            Err(e) => {
                tracing::debug!("qforge serve: connection failed: {e}");
                Closed::Error
            }
        }
    }
}
