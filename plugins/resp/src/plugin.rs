//! The component's `store` export: [`Client`] over the host's `transport`,
//! through backend-core's WIT glue, which holds everything of the WIT (the
//! bindings, error conversions, host connection and `Guest` impl) for every
//! backend plugin.

use crate::client::Client;
use kvplane_backend_core::component::HostDial;

kvplane_backend_core::export_store!(Client<HostDial>);
