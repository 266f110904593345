//! The local path against the socket paths and against memcpy, in one run:
//! batched PUT and GET of 64 KiB and 2 MiB blocks between a client and a
//! node on the same host, through
//!
//! * `shm`: the memory the node shares with the client (PUT_SHM / GET_SHM
//!   from and into that memory: the node makes the one copy),
//! * `unix`: the node's Unix socket (shared memory turned off),
//! * `tcp`: the node's TCP port on loopback,
//!
//! and `memcpy` of the same bytes between two buffers of the same sizes in
//! this process (one copy per block: the ceiling the shm path can approach).
//!
//! Each cell runs `ROUNDS` times for `SECONDS`; the median GB/s is printed,
//! with the ratios the issue judges the local path by (shm ≥ 3× tcp and
//! ≥ 80% of memcpy at 2 MiB). One client connection, batches in sequence:
//! the same shape on every path.
//!
//! Run: `cargo bench -p kvplane-node --bench local_path` (or
//! scripts/bench-local, which records the table).

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Connection, Endpoint};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};

const ROUNDS: usize = 5;
const SECONDS: f64 = 1.0;
/// (block size, blocks per batch, distinct blocks).
const SHAPES: [(usize, usize, usize); 2] = [(64 << 10, 16, 256), (2 << 20, 8, 32)];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn block(seed: usize, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (seed as u8).wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

/// GB/s of `op` (one batch of `bytes` bytes per call) over `SECONDS`.
async fn measure<F, Fut>(bytes: usize, mut op: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed().as_secs_f64() < SECONDS {
        op(n).await;
        n += 1;
    }
    (n * bytes) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn memcpy_gbps(size: usize, batch: usize, distinct: usize) -> f64 {
    let src: Vec<Vec<u8>> = (0..distinct).map(|i| block(i, size).to_vec()).collect();
    let mut dst: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; size]).collect();
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed().as_secs_f64() < SECONDS {
        for (j, d) in dst.iter_mut().enumerate() {
            d.copy_from_slice(&src[(n * batch + j) % distinct]);
        }
        std::hint::black_box(&dst);
        n += 1;
    }
    (n * batch * size) as f64 / start.elapsed().as_secs_f64() / 1e9
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("node.sock");
    let node = Node::start(NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        unix: Some(sock.clone()),
        pool: PoolConfig::new(1 << 30),
        shm_region_bytes: 64 << 20,
        ..NodeConfig::default()
    })
    .await
    .unwrap();
    let tcp_endpoint = Endpoint::Tcp(node.tcp_addr().unwrap().to_string());
    let unix_endpoint = Endpoint::Unix(sock.clone());
    println!("| size | batch | op | shm GB/s | unix GB/s | tcp GB/s | memcpy GB/s | shm/tcp | shm/memcpy |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (size, batch, distinct) in SHAPES {
        let keys: Vec<Bytes> = (0..distinct).map(|i| Bytes::from(format!("b{size}/{i}"))).collect();
        let blocks: Vec<Bytes> = (0..distinct).map(|i| block(i, size)).collect();
        let bytes = size * batch;
        let one = |config: ClientConfig| ClientConfig { connections: 1, ..config };
        let tcp = Client::connect(one(ClientConfig::new(tcp_endpoint.clone()))).await.unwrap();
        let unix = Client::connect(one(ClientConfig { shared_memory: false, ..ClientConfig::new(unix_endpoint.clone()) })).await.unwrap();
        let local = Connection::open(&unix_endpoint, None, Duration::from_secs(30)).await.unwrap();
        let memory = local.shared_memory().expect("the node shares memory").clone();
        // The client's blocks live in the shared memory: PUT from there, GET
        // into a second area of it.
        for (i, b) in blocks.iter().take(batch).enumerate() {
            memory.write_at(i * size, b).unwrap();
        }
        let put_area: Vec<(usize, usize)> = (0..batch).map(|j| (j * size, size)).collect();
        let get_base = batch * size;
        assert!(tcp.put(keys.iter().cloned().zip(blocks.iter().cloned()).collect()).await.unwrap().iter().all(Result::is_ok));

        for op in ["put", "get"] {
            let (mut s, mut u, mut t, mut m) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let pick = |n: usize| -> Vec<usize> { (0..batch).map(|j| (n * batch + j) % distinct).collect() };
                s.push(
                    measure(bytes, |n| {
                        let idx = pick(n);
                        let local = &local;
                        let keys = &keys;
                        let put_area = &put_area;
                        async move {
                            if op == "put" {
                                let e: Vec<(Bytes, usize, usize)> =
                                    idx.iter().zip(put_area).map(|(&i, &(off, len))| (keys[i].clone(), off, len)).collect();
                                assert!(local.put_from_shared(&e).await.unwrap().iter().all(Result::is_ok));
                            } else {
                                let e: Vec<(Bytes, usize, usize)> =
                                    idx.iter().enumerate().map(|(j, &i)| (keys[i].clone(), get_base + j * size, size)).collect();
                                assert!(local.get_into_shared(&e).await.unwrap().iter().all(Result::is_ok));
                            }
                        }
                    })
                    .await,
                );
                for (client, out) in [(&unix, &mut u), (&tcp, &mut t)] {
                    out.push(
                        measure(bytes, |n| {
                            let idx = pick(n);
                            let (keys, blocks) = (&keys, &blocks);
                            async move {
                                if op == "put" {
                                    let e = idx.iter().map(|&i| (keys[i].clone(), blocks[i].clone())).collect();
                                    assert!(client.put(e).await.unwrap().iter().all(Result::is_ok));
                                } else {
                                    let got = client.get(idx.iter().map(|&i| keys[i].clone()).collect()).await.unwrap();
                                    assert!(got.iter().all(Result::is_ok));
                                }
                            }
                        })
                        .await,
                    );
                }
                m.push(memcpy_gbps(size, batch, distinct));
            }
            let (s, u, t, m) = (median(s), median(u), median(t), median(m));
            println!("| {} KiB | {batch} | {op} | {s:.2} | {u:.2} | {t:.2} | {m:.2} | {:.2}x | {:.0}% |", size >> 10, s / t, 100.0 * s / m);
        }
    }
    node.shutdown().await;
}
