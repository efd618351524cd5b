//! The publisher's socket side: writing the buffer, reading into the frame buffer, and the
//! heartbeat timer (AMQP 0-9-1 section 4.2.7), all from [`Publisher::poll_outcomes`] on the
//! pipeline's own task.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use amq_protocol::frame::AMQPFrame;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::{wire, Publisher, State, KEEP_WRITE_CAPACITY, READS_PER_POLL};
use crate::sink::FailureCause;

impl<T> Publisher<T> {
    /// Writes, reads and handles frames until the socket would block both ways (wakers
    /// registered) or outcomes are ready; keeps the heartbeat timer armed.
    pub(super) fn poll_io(&mut self, cx: &mut Context<'_>) {
        loop {
            let queued_before = self.out.len() - self.written;
            self.poll_write(cx);
            if !matches!(self.state, State::Open) {
                return;
            }
            let mut reads = 0;
            loop {
                if reads == READS_PER_POLL {
                    // More to read: come back after the pipeline's other branches.
                    cx.waker().wake_by_ref();
                    break;
                }
                reads += 1;
                match self.poll_read(cx) {
                    Poll::Ready(true) => {}
                    Poll::Ready(false) => {
                        // The broker closed the channel or connection: its close-ok (queued
                        // by handle_frame) goes out, best effort, before we give up.
                        self.poll_write(cx);
                        return;
                    }
                    Poll::Pending => break,
                }
            }
            if !matches!(self.state, State::Open) {
                return;
            }
            if self.poll_timer(cx) {
                continue;
            }
            // Handling frames may have queued replies (close-ok); write them now.
            if self.out.len() - self.written > queued_before && self.written < self.out.len() {
                continue;
            }
            return;
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>) {
        while self.written < self.out.len() {
            match Pin::new(&mut self.socket).poll_write(cx, &self.out[self.written..]) {
                Poll::Ready(Ok(0)) => {
                    self.fail(FailureCause::ConnectionLost(
                        "writing to RabbitMQ returned 0 bytes (socket closed)".into(),
                    ));
                    return;
                }
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.unflushed = true;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => {
                    self.fail(FailureCause::ConnectionLost(format!(
                        "writing to RabbitMQ failed: {e}"
                    )));
                    return;
                }
                Poll::Pending => return,
            }
        }
        self.out_base += self.written as u64;
        self.out.clear();
        self.written = 0;
        if self.out.capacity() > KEEP_WRITE_CAPACITY {
            self.out = Vec::with_capacity(64 * 1024);
        }
        // TLS: a write may leave records in rustls' buffer when the socket would block;
        // flushing sends them (a no-op on plain TCP). Pending registers the waker.
        if self.unflushed {
            match Pin::new(&mut self.socket).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => self.fail(FailureCause::ConnectionLost(format!(
                    "writing to RabbitMQ failed: {e}"
                ))),
                Poll::Pending => {}
            }
        }
    }

    /// One read: `Ready(true)` when bytes were read and handled, `Ready(false)` when the
    /// connection failed, `Pending` when nothing is there (waker registered).
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        let mut rb = ReadBuf::new(&mut self.inbuf[self.in_end..]);
        match Pin::new(&mut self.socket).poll_read(cx, &mut rb) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                self.fail(FailureCause::ConnectionLost(format!(
                    "reading from RabbitMQ failed: {e}"
                )));
                Poll::Ready(false)
            }
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                if n == 0 {
                    let unsettled = self.confirms.unsettled();
                    self.fail(FailureCause::ConnectionLost(format!(
                        "RabbitMQ closed the socket with {unsettled} publishes unconfirmed"
                    )));
                    return Poll::Ready(false);
                }
                self.in_end += n;
                self.last_read = Instant::now();
                self.handle_frames();
                Poll::Ready(matches!(self.state, State::Open))
            }
        }
    }

    /// The heartbeat timer: sends a heartbeat when nothing was written for half the
    /// interval, fails the connection when nothing was read for twice the interval
    /// (section 4.2.7). True when a heartbeat was queued.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(interval) = self.heartbeat else {
            return false;
        };
        let now = Instant::now();
        let dead_at = self.last_read + interval * 2;
        if now >= dead_at {
            self.fail(FailureCause::ConnectionLost(format!(
                "no frame and no heartbeat from RabbitMQ for {} s (heartbeat {} s): the broker or the network is gone",
                (now - self.last_read).as_secs(),
                interval.as_secs()
            )));
            return false;
        }
        let send_at = self.last_write + interval / 2;
        if now >= send_at && self.written == self.out.len() {
            if wire::encode(&mut self.out, &AMQPFrame::Heartbeat).is_ok() {
                self.last_write = now;
            }
            return true;
        }
        let next = if self.written == self.out.len() {
            send_at.min(dead_at)
        } else {
            dead_at
        };
        self.timer.as_mut().reset(next);
        if self.timer.as_mut().poll(cx).is_ready() {
            // Due already (a clock step): look again now.
            cx.waker().wake_by_ref();
        }
        false
    }
}
