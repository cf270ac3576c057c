//! The `tp` field of a `load` body: the service loads one tensor-parallel
//! rank's shard of every tensor (the checkpoint module's `tp` rules) into
//! the set [`shard_name`]`(set, rank, world)`.
//!
//! ```json
//! {"set": "model", "path": "/models/llama",
//!  "tp": {"rank": 3, "world": 8, "rules": [["experts", 1], ["bias", null]]}}
//! ```
//!
//! `rules` (optional) are the caller's, before the built-in ones: a
//! substring of the tensor's name and the dimension split (`null`:
//! replicated).

use serde::{Deserialize, Serialize};

use super::{LoadRequest, validate_set_name};
use crate::checkpoint::{TpRule, TpShard, shard_name};

/// Which shard a load takes: rank `rank` of `world`, the caller's `rules`
/// first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TpRequest {
    /// The rank, from 0.
    pub rank: u32,
    /// How many ranks share the model (1 to 64).
    pub world: u32,
    /// The caller's rules: a pattern (a substring of tensor names) and
    /// the dimension split, or `None` for replicated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<(String, Option<usize>)>,
}

impl TpRequest {
    /// The request for `shard`.
    pub fn new(shard: &TpShard) -> TpRequest {
        TpRequest {
            rank: shard.rank(),
            world: shard.world(),
            rules: shard
                .rules()
                .iter()
                .map(|r| (r.pattern.clone(), r.dim))
                .collect(),
        }
    }

    /// The shard it asks for.
    ///
    /// # Errors
    /// A sentence naming what is wrong: the rank, the world, a rule.
    pub fn shard(&self) -> Result<TpShard, String> {
        let rules = self
            .rules
            .iter()
            .map(|(pattern, dim)| TpRule {
                pattern: pattern.clone(),
                dim: *dim,
            })
            .collect();
        TpShard::new(self.rank, self.world, rules).map_err(|e| format!("tp: {e}"))
    }
}

impl LoadRequest {
    /// The same request for `shard` (`None`: whole tensors).
    #[must_use]
    pub fn with_tp(mut self, shard: Option<&TpShard>) -> LoadRequest {
        self.tp = shard.map(TpRequest::new);
        self
    }

    /// The set the load fills (the shard's name for a shard) and the shard.
    ///
    /// # Errors
    /// A sentence naming the field: a bad shard, or a shard name that is
    /// not a valid set name (too long).
    pub fn target(&self) -> Result<(String, Option<TpShard>), String> {
        let Some(tp) = &self.tp else {
            return Ok((self.set.clone(), None));
        };
        let shard = tp.shard()?;
        let name =
            shard_name(&self.set, shard.rank(), shard.world()).map_err(|e| format!("tp: {e}"))?;
        validate_set_name(&name)?;
        Ok((name, Some(shard)))
    }
}
