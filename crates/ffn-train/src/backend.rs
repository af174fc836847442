//! # Devices compiled in
//!
//! burn decides which backends exist at compile time (cargo features); this module names
//! them for the command line. `--device NAME`, else the `FFN_DEVICE` environment variable,
//! else the first CPU backend compiled in.

use burn::tensor::Device;

use crate::{Error, Result};

/// The device names of this build, preferred first.
pub const DEVICES: &[&str] = &[
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
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
    let device = match name {
        #[cfg(feature = "flex")]
        "flex" => Device::flex(),
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Device::ndarray(),
        other => {
            return Err(Error::Device(format!(
                "unknown or not compiled device `{other}`; this build has: {}",
                DEVICES.join(", ")
            )));
        }
    };
    Ok(device.autodiff())
}
