//! What a machine without a GPU sees: a clear error, never a panic. Built
//! without the `cuda` feature, every entry point answers `NotBuilt`; with
//! it on a machine without a driver or device, `NoDevice` with the reason.
//! (On a machine with a GPU the same calls succeed; scripts/device-check
//! covers that case.)

use kvplane_gpu::{available, GpuContext, GpuError};

#[test]
fn without_a_usable_gpu_every_entry_point_says_why() {
    let probe = available();
    let context = GpuContext::new(0).map(|_| ());
    if cfg!(feature = "cuda") {
        match (&probe, &context) {
            (Ok(()), _) => eprintln!("a CUDA driver and device are present; nothing to check here"),
            (Err(GpuError::NoDevice(why)), Err(GpuError::NoDevice(again))) => {
                assert!(!why.is_empty());
                assert_eq!(why, again, "the probe's answer is kept");
                assert!(format!("{}", probe.unwrap_err()).starts_with("no usable GPU: "));
            }
            other => panic!("expected NoDevice from both, got {other:?}"),
        }
    } else {
        assert_eq!(probe, Err(GpuError::NotBuilt));
        assert_eq!(context, Err(GpuError::NotBuilt));
        assert!(GpuError::NotBuilt.to_string().contains("`cuda` feature"));
    }
}

#[test]
fn a_missing_driver_library_is_named() {
    // Only meaningful with the feature, on a machine without libcuda.
    if let Err(GpuError::NoDevice(why)) = available() {
        if why.contains("could not be loaded") {
            assert!(why.contains("libcuda.so"), "{why}");
        }
    }
}
