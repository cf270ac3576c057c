//! Tensor-parallel shards: the bytes of each tensor that rank `R` of `N`
//! takes, as an engine with `N` ranks expects them (vLLM's column- and
//! row-parallel layers).
//!
//! - **Names.** Rank `R`'s shard of set `set` is the set
//!   [`shard_name`]`(set, R, N)`: `{set}.tp{R}-of-{N}`, `1 <= N <=`
//!   [`MAX_TP_WORLD`], `R < N`.
//! - **Rules.** Each tensor is split along one dimension or replicated,
//!   by the first rule that matches its name: the caller's rules
//!   ([`TpRule`], a substring of the name) first, then the built-in rules
//!   for Llama-, Qwen- and Mistral-style names ([`BUILTIN_RULES`]: a
//!   whole dot-separated part of the name), then replication.
//! - **Bytes.** A split along dimension `d` of a tensor of shape
//!   `[outer.., D, inner..]` gives rank `R` the `D/N` rows `R*D/N..` of
//!   that dimension: in the file, `outer` (the product of the dimensions
//!   before `d`) runs of `(D/N)*inner*e` bytes, one every `D*inner*e`
//!   bytes (`e` the element size), the first at `R*(D/N)*inner*e` from
//!   the tensor's start. A split along dimension 0 is one contiguous
//!   range. The shard's shape is the tensor's with `D/N` for `D`.
//! - **Refusals**, each naming the tensor and what to do: a split
//!   dimension not divisible by `N` (for `f4e2m1fnx2`, whose last
//!   dimension counts bytes of two values, in bytes), a dimension the
//!   tensor does not have, and the built-in refusals (fused projections
//!   and tensors of a split module other than its `weight` and `bias`,
//!   whose layout is a quantizer's: say with a rule how to split them).

use std::fmt;
use std::str::FromStr;

use super::TensorEntry;
use crate::descriptor::Dtype;
use crate::error::{Error, Result};
use crate::units::shorten;

/// The most ranks a shard set names.
pub const MAX_TP_WORLD: u32 = 64;

/// The most rules a caller gives.
pub const MAX_TP_RULES: usize = 64;

/// The longest pattern of a rule, in bytes.
pub const MAX_TP_PATTERN_LEN: usize = 256;

/// The name of rank `rank`'s shard of set `set` among `world` ranks:
/// `{set}.tp{rank}-of-{world}` (`model.tp3-of-8`).
///
/// # Errors
/// An empty `set`; `world` not from 1 to [`MAX_TP_WORLD`]; `rank` not
/// below `world`.
pub fn shard_name(set: &str, rank: u32, world: u32) -> Result<String> {
    if set.is_empty() {
        return Err(Error::arg("tensor-parallel set", "the set name is empty"));
    }
    check_rank(rank, world)?;
    Ok(format!("{set}.tp{rank}-of-{world}"))
}

fn check_rank(rank: u32, world: u32) -> Result<()> {
    if world == 0 || world > MAX_TP_WORLD {
        return Err(Error::arg(
            "tensor-parallel world",
            format!("{world} ranks; give 1 to {MAX_TP_WORLD}"),
        ));
    }
    if rank >= world {
        return Err(Error::arg(
            "tensor-parallel rank",
            format!(
                "rank {rank} of {world}: ranks count from 0 to {}",
                world - 1
            ),
        ));
    }
    Ok(())
}

/// A caller's rule: the tensors whose name contains `pattern` are split
/// along dimension `dim`, or replicated (`None`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TpRule {
    /// A substring of the names the rule applies to.
    pub pattern: String,
    /// The dimension split among the ranks; `None`: every rank takes the
    /// whole tensor.
    pub dim: Option<usize>,
}

impl TpRule {
    /// Split the tensors whose name contains `pattern` along `dim`.
    pub fn split(pattern: impl Into<String>, dim: usize) -> TpRule {
        TpRule {
            pattern: pattern.into(),
            dim: Some(dim),
        }
    }

    /// Give every rank the whole of the tensors whose name contains
    /// `pattern`.
    pub fn replicate(pattern: impl Into<String>) -> TpRule {
        TpRule {
            pattern: pattern.into(),
            dim: None,
        }
    }

    /// Checks the pattern: not empty, at most [`MAX_TP_PATTERN_LEN`] bytes.
    ///
    /// # Errors
    /// A sentence naming the rule.
    pub fn validate(&self) -> Result<()> {
        if self.pattern.is_empty() || self.pattern.len() > MAX_TP_PATTERN_LEN {
            return Err(Error::arg(
                "tensor-parallel rule",
                format!(
                    "{}: the pattern must have 1 to {MAX_TP_PATTERN_LEN} bytes",
                    shorten(&self.to_string(), 80)
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for TpRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dim {
            Some(d) => write!(f, "{}={d}", self.pattern),
            None => write!(f, "{}=replicate", self.pattern),
        }
    }
}

impl FromStr for TpRule {
    type Err = Error;

    /// `PATTERN=DIM` or `PATTERN=replicate` (the last `=` separates them).
    fn from_str(s: &str) -> Result<TpRule> {
        let bad = |why: &str| {
            Error::arg(
                "tensor-parallel rule",
                format!(
                    "{}: {why}; write PATTERN=DIM (a dimension, from 0) or PATTERN=replicate",
                    shorten(s, 80)
                ),
            )
        };
        let (pattern, action) = s.rsplit_once('=').ok_or_else(|| bad("no `=`"))?;
        let rule = match action {
            "replicate" => TpRule::replicate(pattern),
            d => TpRule::split(pattern, d.parse().map_err(|_| bad("not a dimension"))?),
        };
        rule.validate()?;
        Ok(rule)
    }
}

/// What a built-in rule does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuiltinAction {
    /// Split along this dimension.
    Split(usize),
    /// Every rank takes the whole tensor.
    Replicate,
    /// Refused, for this reason: the layout is not an even split.
    Refuse(&'static str),
}

const FUSED: &str = "a fused projection: engines split each of its parts separately, \
                     which an even split of the whole does not give";
const OTHER: &str = "a tensor of a tensor-parallel module other than its weight and \
                     bias (a quantizer's scale or packed weight): its layout is the \
                     quantizer's";

/// The built-in rules, in order, after the caller's: each matches the
/// names that hold its pattern as whole dot-separated parts
/// (`q_proj.weight` matches `model.layers.0.self_attn.q_proj.weight`,
/// not `q_proj.weight_scale`). Column-parallel layers split dimension 0
/// (weights and biases), row-parallel ones dimension 1 (their biases are
/// replicated), as vLLM shards Llama, Qwen and Mistral models.
pub const BUILTIN_RULES: &[(&str, BuiltinAction)] = {
    use BuiltinAction::{Refuse, Replicate, Split};
    &[
        ("q_proj.weight", Split(0)),
        ("q_proj.bias", Split(0)),
        ("k_proj.weight", Split(0)),
        ("k_proj.bias", Split(0)),
        ("v_proj.weight", Split(0)),
        ("v_proj.bias", Split(0)),
        ("gate_proj.weight", Split(0)),
        ("gate_proj.bias", Split(0)),
        ("up_proj.weight", Split(0)),
        ("up_proj.bias", Split(0)),
        ("o_proj.weight", Split(1)),
        ("o_proj.bias", Replicate),
        ("down_proj.weight", Split(1)),
        ("down_proj.bias", Replicate),
        ("embed_tokens.weight", Split(0)),
        ("lm_head.weight", Split(0)),
        ("qkv_proj", Refuse(FUSED)),
        ("gate_up_proj", Refuse(FUSED)),
        ("q_proj", Refuse(OTHER)),
        ("k_proj", Refuse(OTHER)),
        ("v_proj", Refuse(OTHER)),
        ("gate_proj", Refuse(OTHER)),
        ("up_proj", Refuse(OTHER)),
        ("o_proj", Refuse(OTHER)),
        ("down_proj", Refuse(OTHER)),
        ("embed_tokens", Refuse(OTHER)),
        ("lm_head", Refuse(OTHER)),
    ]
};

/// Whether `pattern` occurs in `name` as whole dot-separated parts.
fn holds_parts(name: &str, pattern: &str) -> bool {
    name.match_indices(pattern).any(|(at, _)| {
        let end = at + pattern.len();
        (at == 0 || name.as_bytes()[at - 1] == b'.')
            && (end == name.len() || name.as_bytes()[end] == b'.')
    })
}

/// One rank's shard: its rank, the world and the caller's rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpShard {
    rank: u32,
    world: u32,
    rules: Vec<TpRule>,
}

impl TpShard {
    /// Rank `rank` of `world`, with the caller's `rules` before the
    /// built-in ones.
    ///
    /// # Errors
    /// `world` not from 1 to [`MAX_TP_WORLD`], `rank` not below it; more
    /// than [`MAX_TP_RULES`] rules or a rule that does not validate.
    pub fn new(rank: u32, world: u32, rules: Vec<TpRule>) -> Result<TpShard> {
        check_rank(rank, world)?;
        if rules.len() > MAX_TP_RULES {
            return Err(Error::arg(
                "tensor-parallel rules",
                format!("{} rules, more than {MAX_TP_RULES}", rules.len()),
            ));
        }
        for r in &rules {
            r.validate()?;
        }
        Ok(TpShard { rank, world, rules })
    }

    /// The rank, from 0.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// How many ranks there are.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// The caller's rules.
    pub fn rules(&self) -> &[TpRule] {
        &self.rules
    }

    /// The shard's set name: [`shard_name`]`(set, rank, world)`.
    ///
    /// # Errors
    /// An empty `set`.
    pub fn set_name(&self, set: &str) -> Result<String> {
        shard_name(set, self.rank, self.world)
    }

    /// The dimension tensor `name` is split along (`None`: replicated),
    /// and the rule that said so; or why it is refused.
    fn split_of(&self, name: &str) -> std::result::Result<(Option<usize>, String), String> {
        if let Some(r) = self.rules.iter().find(|r| name.contains(&r.pattern)) {
            return Ok((r.dim, format!("the rule {}", shorten(&r.to_string(), 80))));
        }
        for &(pattern, action) in BUILTIN_RULES {
            if holds_parts(name, pattern) {
                let rule = |what: &str| format!("the built-in rule {pattern}={what}");
                return match action {
                    BuiltinAction::Split(d) => Ok((Some(d), rule(&d.to_string()))),
                    BuiltinAction::Replicate => Ok((None, rule("replicate"))),
                    BuiltinAction::Refuse(why) => Err(format!(
                        "{why}; say how to shard it with a rule (PATTERN=DIM or \
                         PATTERN=replicate) that matches it"
                    )),
                };
            }
        }
        Ok((None, "no rule (replicated)".into()))
    }

    /// Where this rank's share of `t` lies in its file, or why it cannot
    /// be taken (a sentence that says what to do).
    pub(crate) fn slice(&self, t: &TensorEntry) -> std::result::Result<Slice, String> {
        let (dim, rule) = self.split_of(&t.name)?;
        let Some(d) = dim else {
            return Ok(Slice::whole(t));
        };
        let n = u64::from(self.world);
        let Some(&full) = t.shape.get(d) else {
            return Err(format!(
                "{rule} splits dimension {d}, but shape {:?} has no dimension {d}; give a \
                 rule with a dimension it has, or PATTERN=replicate",
                t.shape
            ));
        };
        if !full.is_multiple_of(n) {
            let packed = if t.dtype == Dtype::F4E2m1fnX2 && d + 1 == t.shape.len() {
                " (bytes of two f4 values each: a rank's share may not start inside a byte)"
            } else {
                ""
            };
            return Err(format!(
                "{rule} splits dimension {d} of shape {:?}, {full}{packed}, which {n} ranks \
                 cannot share evenly; load with a world that divides it, or give a rule \
                 for it first (PATTERN=replicate, or another dimension)",
                t.shape
            ));
        }
        let product = |dims: &[u64]| dims.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
        let outer = product(&t.shape[..d]);
        let inner = product(&t.shape[d + 1..]).and_then(|i| i.checked_mul(t.dtype.size()));
        let pitch = inner.and_then(|i| i.checked_mul(full));
        let (Some(outer), Some(inner), Some(pitch)) = (outer, inner, pitch) else {
            return Err(format!("shape {:?} overflows 64 bits", t.shape));
        };
        let part = full / n;
        let mut shape = t.shape.clone();
        shape[d] = part;
        let width = part * inner;
        Ok(Slice::new(
            shape,
            t.range.start + u64::from(self.rank) * width,
            outer,
            pitch,
            width,
        ))
    }
}

/// Where one rank's share of a tensor lies in its file: `rows` runs of
/// `width` bytes, one every `pitch` bytes, the first at `first`. One run
/// (`rows == 1`, `pitch == width`) when the bytes are contiguous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Slice {
    /// The shape as loaded.
    pub shape: Vec<u64>,
    pub first: u64,
    pub rows: u64,
    pub pitch: u64,
    pub width: u64,
}

impl Slice {
    fn new(shape: Vec<u64>, first: u64, rows: u64, pitch: u64, width: u64) -> Slice {
        if rows <= 1 || width == pitch {
            let width = rows * width;
            return Slice {
                shape,
                first,
                rows: 1,
                pitch: width,
                width,
            };
        }
        Slice {
            shape,
            first,
            rows,
            pitch,
            width,
        }
    }

    /// The whole tensor.
    pub fn whole(t: &TensorEntry) -> Slice {
        Slice::new(t.shape.clone(), t.range.start, 1, t.len(), t.len())
    }

    /// The bytes loaded.
    pub fn len(&self) -> u64 {
        self.rows * self.width
    }
}

/// The slices of `tensors` for `shard` (each whole for `None`), or the
/// index of the first tensor refused and why.
pub(crate) fn slices(
    tensors: &[TensorEntry],
    shard: Option<&TpShard>,
) -> std::result::Result<Vec<Slice>, (usize, String)> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| match shard {
            Some(s) => s.slice(t).map_err(|why| (i, why)),
            None => Ok(Slice::whole(t)),
        })
        .collect()
}

#[cfg(test)]
mod tests;
