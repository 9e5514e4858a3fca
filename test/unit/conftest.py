"""Every unit test sees 8 CPU devices, as the plans under test need several devices, and a
thread pool their collectives cannot starve (`hlopar.runtime.host_devices`)."""

import os

from hlopar.runtime.host_devices import use_host_devices

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
