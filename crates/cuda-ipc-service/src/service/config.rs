//! How a [`Service`](super::Service) runs: [`ServiceConfig`].

use super::catalog::Quotas;
use crate::checkpoint::PlanOptions;

/// How a [`Service`](super::Service) runs: `ServiceConfig::default()` and the `with_`
/// methods.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ServiceConfig {
    /// Quotas in bytes (default `None`: [`Quotas::for_device`] of the
    /// service's device, a quarter of its memory for each uid other than
    /// the service's own; [`Quotas::unlimited`] for none).
    pub quotas: Option<Quotas>,
    /// User ids allowed to connect besides the service's own.
    pub allow_uids: Vec<u32>,
    /// The loader's options when a load asks for none (streams, staging).
    pub load: PlanOptions,
}

impl ServiceConfig {
    /// Sets the quotas.
    #[must_use]
    pub fn with_quotas(mut self, quotas: Quotas) -> Self {
        self.quotas = Some(quotas);
        self
    }

    /// Lets these user ids connect too.
    #[must_use]
    pub fn with_allow_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allow_uids.extend(uids);
        self
    }

    /// Sets the loader's default options.
    #[must_use]
    pub fn with_load_options(mut self, options: PlanOptions) -> Self {
        self.load = options;
        self
    }
}
