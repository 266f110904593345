//! The device check (`scripts/device-check`): on a machine with an NVIDIA
//! GPU and a local node on a Unix socket, measures and verifies kvplane's
//! GPU path in one run:
//!
//! 1. pinned device-to-host and host-to-device bandwidth through kvplane's
//!    path (the node's shared memory, registered as pinned, in blocks) next
//!    to a plain pinned copy (`cuMemAllocHost` memory, one `cuMemcpyAsync`
//!    per pass), with the ratio against the goal of 90%;
//! 2. a CUDA IPC handle exported by a second process (this binary again,
//!    with `--ipc-child`), imported here, read directly and put through the
//!    node from the imported memory, every byte compared;
//! 3. a put-from-device / get-into-device round trip of more blocks than
//!    the shared memory holds at once, every byte compared.
//!
//! Prints one line per figure; exits non-zero when a check fails (the
//! bandwidth goal is reported, not enforced).

use std::io::{BufRead, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint};
use kvplane_gpu::{DeviceBuffer, GpuContext, PinnedRegion, Stream};

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "usage: kvplane-device-check --unix SOCKET [--device N] [--block BYTES] [--total BYTES] [--passes N] [--ipc BYTES]";

struct Args {
    unix: std::path::PathBuf,
    device: usize,
    block: usize,
    total: usize,
    passes: usize,
    ipc: usize,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, Error> {
    let mut a = Args { unix: Default::default(), device: 0, block: 4 << 20, total: 256 << 20, passes: 20, ipc: 64 << 20 };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--unix" => a.unix = value()?.into(),
            "--device" => a.device = value()?.parse()?,
            "--block" => a.block = value()?.parse()?,
            "--total" => a.total = value()?.parse()?,
            "--passes" => a.passes = value()?.parse()?,
            "--ipc" => a.ipc = value()?.parse()?,
            _ => return Err(format!("unknown argument {flag:?}\n{USAGE}").into()),
        }
    }
    if a.unix.as_os_str().is_empty() {
        return Err(USAGE.into());
    }
    if a.block == 0 || a.total < a.block || a.passes == 0 || a.ipc < a.block {
        return Err("--block must be > 0 and no more than --total and --ipc; --passes > 0".into());
    }
    Ok(a)
}

/// Deterministic bytes for block contents: xorshift64 from `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// One (key, device pointer, length) entry per key: key `i` is the `i`th
/// `block`-byte block from device address `base`.
fn entries(keys: &[Bytes], base: u64, block: usize) -> Vec<(Bytes, u64, usize)> {
    keys.iter().enumerate().map(|(i, k)| (k.clone(), base + (i * block) as u64, block)).collect()
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("--ipc-child") {
        return match ipc_child(args.skip(1)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ipc child: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(check(args)) {
        Ok(()) => {
            println!("device check: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("device check: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The second process: allocates device memory, fills it with a known
/// pattern, prints its IPC handle (hex) and holds it until stdin closes.
fn ipc_child(mut args: impl Iterator<Item = String>) -> Result<(), Error> {
    let bytes: usize = args.next().ok_or("--ipc-child BYTES SEED DEVICE")?.parse()?;
    let seed: u64 = args.next().ok_or("--ipc-child BYTES SEED DEVICE")?.parse()?;
    let device: usize = args.next().ok_or("--ipc-child BYTES SEED DEVICE")?.parse()?;
    let ctx = GpuContext::new(device)?;
    let stream = Stream::new(&ctx)?;
    let buf = ctx.alloc(bytes)?;
    buf.write(0, &pattern(seed, bytes), &stream)?;
    let handle = buf.ipc_handle()?;
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{hex}")?;
    out.flush()?;
    drop(out);
    // Hold the memory until the importer is done with it.
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest)?;
    drop(buf);
    Ok(())
}

async fn check(args: Args) -> Result<(), Error> {
    let ctx = GpuContext::new(args.device)?;
    println!("device {}: {}", args.device, ctx.device_name());
    let stream = Stream::new(&ctx)?;

    let mut config = ClientConfig::new(Endpoint::Unix(args.unix.clone()));
    config.connections = 1;
    let client = Client::connect(config).await?;
    let conn = client.connection().await?;
    let region = PinnedRegion::for_connection(&ctx, &conn)?;
    let size = region.memory().len();
    if size < args.block {
        return Err(format!("the node shares {size} bytes, less than one {}-byte block (raise --shm-region)", args.block).into());
    }
    println!("shared memory: {} MiB, registered as pinned", size >> 20);

    bandwidth(&ctx, &region, &stream, &args)?;
    ipc(&ctx, &region, &conn, &stream, &args).await?;
    round_trip(&ctx, &region, &conn, &stream, &args).await?;
    Ok(())
}

/// Pinned bandwidth both ways: the plain ceiling and kvplane's path, each
/// over the same bytes per pass (as many whole blocks as the shared memory
/// holds), timed from the first enqueue to the stream's end.
fn bandwidth(ctx: &Arc<GpuContext>, region: &PinnedRegion, stream: &Stream, args: &Args) -> Result<(), Error> {
    let blocks = region.memory().len() / args.block;
    let bytes = blocks * args.block;
    let device = ctx.alloc(bytes)?;
    device.write(0, &pattern(1, bytes), stream)?;
    let mut host = ctx.alloc_pinned_host(bytes)?;
    let plan: Vec<(u64, usize, usize)> =
        (0..blocks).map(|i| (device.ptr() + (i * args.block) as u64, i * args.block, args.block)).collect();

    let time = |enqueue: &mut dyn FnMut() -> Result<(), kvplane_gpu::GpuError>| -> Result<f64, Error> {
        enqueue()?; // warm-up
        stream.wait()?;
        let start = Instant::now();
        for _ in 0..args.passes {
            enqueue()?;
        }
        stream.wait()?;
        Ok(gbps(bytes * args.passes, start.elapsed().as_secs_f64()))
    };
    let plain_d2h = time(&mut || host.copy_from_device(&device, bytes, stream))?;
    let plain_h2d = time(&mut || host.copy_to_device(&device, bytes, stream))?;
    let ours_d2h = time(&mut || region.stage_from_device(&plan, stream))?;
    let ours_h2d = time(&mut || region.unstage_to_device(&plan, stream))?;

    println!("bandwidth: {} MiB per pass, {} passes, kvplane in {} blocks of {} KiB", bytes >> 20, args.passes, blocks, args.block >> 10);
    let d2h = ours_d2h / plain_d2h * 100.0;
    let h2d = ours_h2d / plain_h2d * 100.0;
    println!("  device-to-host: plain pinned cuMemcpy {plain_d2h:.1} GB/s | kvplane pinned shared memory {ours_d2h:.1} GB/s ({d2h:.0}%)");
    println!("  host-to-device: plain pinned cuMemcpy {plain_h2d:.1} GB/s | kvplane pinned shared memory {ours_h2d:.1} GB/s ({h2d:.0}%)");
    let met = d2h >= 90.0 && h2d >= 90.0;
    println!("  goal (kvplane >= 90% of plain, both ways): {}", if met { "met" } else { "NOT met" });
    Ok(())
}

/// A second process exports device memory; it is imported here, read
/// directly, and put through the node from the imported pointer, then got
/// back into memory of this process: every byte compared both times.
async fn ipc(
    ctx: &Arc<GpuContext>,
    region: &PinnedRegion,
    conn: &kvplane_client::Connection,
    stream: &Stream,
    args: &Args,
) -> Result<(), Error> {
    let seed = 7;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--ipc-child", &args.ipc.to_string(), &seed.to_string(), &args.device.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let result = async {
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().ok_or("no child stdout")?).read_line(&mut line)?;
        let hex = line.trim();
        if hex.len() != 128 {
            return Err(format!("the second process printed {hex:?}, not a 64-byte handle").into());
        }
        let handle: Vec<u8> = (0..64).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)).collect::<Result<_, _>>()?;
        let imported = ctx.import_ipc_handle(&handle)?;
        if imported.len() < args.ipc {
            return Err(format!("the imported allocation has {} bytes, {} were exported", imported.len(), args.ipc).into());
        }
        let expected = pattern(seed, args.ipc);
        let mut direct = vec![0u8; args.ipc];
        imported.read(0, &mut direct, stream)?;
        if let Some(at) = first_difference(&direct, &expected) {
            return Err(format!("ipc: the imported memory differs from what the second process wrote at byte {at}").into());
        }
        let n = args.ipc / args.block;
        let keys: Vec<Bytes> = (0..n).map(|i| Bytes::from(format!("device-check/ipc/{i}"))).collect();
        for (i, r) in region.put_from_device(conn, &entries(&keys, imported.ptr(), args.block), stream).await?.into_iter().enumerate() {
            r.map_err(|e| format!("ipc: put of block {i} from the imported memory: {e}"))?;
        }
        let local = ctx.alloc(n * args.block)?;
        fetch_and_compare(region, conn, stream, &keys, &local, args.block, &expected[..n * args.block])
            .await
            .map_err(|e| format!("ipc: {e}"))?;
        println!(
            "ipc: imported {} MiB exported by a second process (pid {}): read directly and put through the node from it ({n} blocks), got back: every byte matches",
            args.ipc >> 20,
            child.id(),
        );
        Ok::<(), Error>(())
    }
    .await;
    drop(child.stdin.take());
    let status = child.wait()?;
    result?;
    if !status.success() {
        return Err(format!("the second process exited with {status}").into());
    }
    Ok(())
}

/// Gets `keys` into `local` (one block each, in order) and compares the
/// whole buffer with `expected`; answers the seconds the gets took.
async fn fetch_and_compare(
    region: &PinnedRegion,
    conn: &kvplane_client::Connection,
    stream: &Stream,
    keys: &[Bytes],
    local: &DeviceBuffer,
    block: usize,
    expected: &[u8],
) -> Result<f64, Error> {
    local.write(0, &vec![0u8; expected.len()], stream)?;
    let start = Instant::now();
    let results = region.get_into_device(conn, &entries(keys, local.ptr(), block), stream).await?;
    let secs = start.elapsed().as_secs_f64();
    for (i, r) in results.into_iter().enumerate() {
        let len = r.map_err(|e| format!("get of block {i}: {e}"))?;
        if len != block {
            return Err(format!("block {i} came back with {len} bytes, {block} were put").into());
        }
    }
    let mut back = vec![0u8; expected.len()];
    local.read(0, &mut back, stream)?;
    if let Some(at) = first_difference(&back, expected) {
        return Err(format!("the bytes got back into the device differ from those put, first at byte {at}").into());
    }
    Ok(secs)
}

/// Puts `--total` bytes of device blocks through the node and gets them
/// back into other device memory, timing both directions.
async fn round_trip(
    ctx: &Arc<GpuContext>,
    region: &PinnedRegion,
    conn: &kvplane_client::Connection,
    stream: &Stream,
    args: &Args,
) -> Result<(), Error> {
    let n = args.total / args.block;
    let bytes = n * args.block;
    let expected = pattern(3, bytes);
    let src = ctx.alloc(bytes)?;
    src.write(0, &expected, stream)?;
    let keys: Vec<Bytes> = (0..n).map(|i| Bytes::from(format!("device-check/round-trip/{i}"))).collect();
    let start = Instant::now();
    let results = region.put_from_device(conn, &entries(&keys, src.ptr(), args.block), stream).await?;
    let put_secs = start.elapsed().as_secs_f64();
    for (i, r) in results.into_iter().enumerate() {
        r.map_err(|e| format!("round trip: put of block {i}: {e}"))?;
    }
    let dst = ctx.alloc(bytes)?;
    let get_secs =
        fetch_and_compare(region, conn, stream, &keys, &dst, args.block, &expected).await.map_err(|e| format!("round trip: {e}"))?;
    println!(
        "round trip: {n} blocks of {} KiB ({} MiB through {} MiB of shared memory): put_from_device {:.1} GB/s, get_into_device {:.1} GB/s, every byte matches",
        args.block >> 10,
        bytes >> 20,
        region.memory().len() >> 20,
        gbps(bytes, put_secs),
        gbps(bytes, get_secs)
    );
    Ok(())
}
