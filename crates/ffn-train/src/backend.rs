//! # Devices compiled in
//!
//! burn decides which backends exist at compile time (cargo features); this module names
//! them for the command line. `--device NAME`, else the `FFN_DEVICE` environment variable,
//! else the first CPU backend compiled in.
//! `cuda` (feature `cuda`) takes the first NVIDIA GPU, an error when there is none.
//! `wgpu` (feature `wgpu`) takes the adapter wgpu prefers (a discrete GPU first; any Vulkan,
//! Metal or DX12 one, Mesa's software `lavapipe` included), and is an error, not a panic, when
//! the machine has none.

use burn::tensor::Device;

use crate::error::{Error, Result};

/// The device names of this build, preferred first.
pub const DEVICES: &[&str] = &[
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
    #[cfg(feature = "wgpu")]
    "wgpu",
    #[cfg(feature = "cuda")]
    "cuda",
];

/// The environment variable read when no `--device` is given.
pub const DEVICE_VARIABLE: &str = "FFN_DEVICE";

/// The device called `name` (or chosen by `FFN_DEVICE`, or the default), with autodiff.
pub fn device(name: Option<&str>) -> Result<Device> {
    let from_env = std::env::var(DEVICE_VARIABLE).ok();
    let name = name
        .or(from_env.as_deref())
        .or(DEVICES.first().copied())
        .ok_or_else(|| {
            Error::Device(
                "this build has no backend: enable the `flex` or `ndarray` feature".into(),
            )
        })?;
    let device: Result<Device> = match name {
        #[cfg(feature = "flex")]
        "flex" => Ok(Device::flex()),
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Ok(Device::ndarray()),
        #[cfg(feature = "wgpu")]
        "wgpu" => wgpu(),
        #[cfg(feature = "cuda")]
        "cuda" => cuda(),
        other => Err(Error::Device(format!(
            "unknown or not compiled device `{other}`; this build has: {}",
            DEVICES.join(", ")
        ))),
    };
    Ok(device?.autodiff())
}

/// A device as a person reads it: `flex (CPU)`, `wgpu (GPU)`, `cuda (NVIDIA GPU)`.
pub fn describe(device: &Device) -> String {
    // burn names the backend only in the device's Debug form.
    let debug = format!("{device:?}");
    let kind = [
        ("Flex", "flex (CPU)"),
        ("NdArray", "ndarray (CPU)"),
        ("Cuda", "cuda (NVIDIA GPU)"),
        ("Wgpu", "wgpu (GPU)"),
        ("Vulkan", "vulkan (GPU)"),
        ("Metal", "metal (GPU)"),
    ]
    .into_iter()
    .find(|(tag, _)| debug.contains(tag));
    kind.map_or(debug, |(_, name)| name.to_string())
}

/// What the device's matrix products run on: on Flex, the kernel [`ffn_model::cpu_kernels`]
/// chose and the CPU; elsewhere the device itself ([`describe`]) and the type a bf16 run's
/// products take there ([`ffn_model::Precision::operands_on`]: f16 on a GPU without bf16, f32
/// where there is neither).
pub fn kernels(device: &Device) -> String {
    #[cfg(feature = "flex")]
    if matches!(
        device.clone().without_autodiff().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    ) {
        return ffn_model::cpu_kernels().to_string();
    }
    let bf16 = match ffn_model::Precision::Bf16.operands_on(device) {
        burn::tensor::DType::BF16 => "bf16 operands",
        burn::tensor::DType::F16 => "f16 operands (this device computes in f16, not bf16)",
        _ => "f32 (this device computes in neither bf16 nor f16)",
    };
    format!("{}; bf16: {bf16}", describe(device))
}

/// The wgpu device, initialised once per process (burn's runtime cannot be initialised twice):
/// an error naming the cause when no adapter can be had.
#[cfg(feature = "wgpu")]
pub fn wgpu() -> Result<Device> {
    use std::sync::OnceLock;
    static DEVICE: OnceLock<std::result::Result<Device, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| Device::wgpu_options().init().map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| {
            Error::Device(format!(
                "no wgpu adapter could be initialised ({e}); a GPU driver with Vulkan, Metal or \
                 DX12 is needed (without a GPU: Mesa's software Vulkan, package \
                 mesa-vulkan-drivers)"
            ))
        })
}

/// The first CUDA device: an error naming the cause when there is none (no NVIDIA GPU, or no
/// driver: `libcuda` is loaded at run time).
#[cfg(feature = "cuda")]
pub fn cuda() -> Result<Device> {
    use burn::tensor::DeviceType;
    // Enumerating loads the driver, which panics inside cudarc when it is missing.
    let devices = std::panic::catch_unwind(|| Device::enumerate(DeviceType::Cuda).into_vec());
    match devices {
        Ok(devices) => devices.into_iter().next().ok_or_else(|| {
            Error::Device("no CUDA device found (an NVIDIA GPU and its driver are needed)".into())
        }),
        Err(_) => Err(Error::Device(
            "the CUDA driver could not be loaded (libcuda; an NVIDIA GPU and its driver are \
             needed)"
                .into(),
        )),
    }
}
