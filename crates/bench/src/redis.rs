//! The redis-server baseline: pipelined SET and GET of the same blocks.
//!
//! A batch is `batch` commands written in one vectored write (the block
//! bytes are not copied into a command buffer) followed by `batch` replies:
//! redis-server's best case for this workload, and what a well-written RESP
//! client does.

use anyhow::{bail, Context as _};
use bytes::Bytes;
use kvplane_protocol::io::{read_bytes, write_frame};
use kvplane_protocol::EncodedFrame;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

use super::{dial, BoxRead, BoxWrite};

pub struct RedisClient {
    reader: BoxRead,
    writer: BoxWrite,
    line: Vec<u8>,
}

impl RedisClient {
    pub async fn connect(endpoint: &str) -> anyhow::Result<RedisClient> {
        let (reader, writer) = dial(endpoint).await?;
        Ok(RedisClient { reader, writer, line: Vec::with_capacity(64) })
    }

    pub async fn set(&mut self, keys: &[Bytes], value: &Bytes) -> anyhow::Result<()> {
        let mut payloads = Vec::with_capacity(keys.len() * 2 + 1);
        for (i, k) in keys.iter().enumerate() {
            let prefix = format!(
                "{}*3\r\n$3\r\nSET\r\n${}\r\n{}\r\n${}\r\n",
                if i == 0 { "" } else { "\r\n" },
                k.len(),
                String::from_utf8_lossy(k),
                value.len()
            );
            payloads.push(Bytes::from(prefix));
            payloads.push(value.clone());
        }
        payloads.push(Bytes::from_static(b"\r\n"));
        write_frame(&mut self.writer, &EncodedFrame { head: Vec::new(), payloads }).await?;
        for k in keys {
            let line = self.read_line().await?;
            if line != b"+OK" {
                bail!("SET {} answered {}", String::from_utf8_lossy(k), String::from_utf8_lossy(line));
            }
        }
        Ok(())
    }

    /// Returns how many keys were missing.
    pub async fn get(&mut self, keys: &[Bytes], block_size: usize) -> anyhow::Result<u64> {
        let mut cmd = Vec::with_capacity(keys.len() * 40);
        for k in keys {
            cmd.extend_from_slice(format!("*2\r\n$3\r\nGET\r\n${}\r\n", k.len()).as_bytes());
            cmd.extend_from_slice(k);
            cmd.extend_from_slice(b"\r\n");
        }
        write_frame(&mut self.writer, &EncodedFrame { head: cmd, payloads: vec![] }).await?;
        let mut misses = 0;
        for k in keys {
            let line = self.read_line().await?;
            let len: i64 = line
                .strip_prefix(b"$")
                .and_then(|n| std::str::from_utf8(n).ok())
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("GET {} answered {}", String::from_utf8_lossy(k), String::from_utf8_lossy(line)))?;
            if len < 0 {
                misses += 1;
                continue;
            }
            if len as usize != block_size {
                bail!("GET {} returned {len} bytes, expected {block_size}", String::from_utf8_lossy(k));
            }
            let data = read_bytes(&mut self.reader, len as usize).await?;
            std::hint::black_box(&data);
            let mut crlf = [0u8; 2];
            self.reader.read_exact(&mut crlf).await?;
        }
        Ok(misses)
    }

    async fn read_line(&mut self) -> anyhow::Result<&[u8]> {
        self.line.clear();
        let n = self.reader.read_until(b'\n', &mut self.line).await?;
        if n == 0 {
            bail!("redis-server closed the connection");
        }
        while matches!(self.line.last(), Some(b'\n' | b'\r')) {
            self.line.pop();
        }
        Ok(&self.line)
    }
}
