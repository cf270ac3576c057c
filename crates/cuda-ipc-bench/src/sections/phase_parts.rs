//! A row's phases: the durations of the library's calls, phase by phase,
//! by their own clock (`cuda_ipc::phases`), sample by sample.

use crate::report::Row;

/// The phases of the library's calls in each kept sample, by their own
/// clock (`cuda_ipc::phases`), as parts named `CALL: PHASE`, ms: where the
/// time of a publish, an attach or an update goes (the JSON report keeps
/// them all).
#[derive(Default)]
pub(super) struct PhaseParts(Vec<(String, Vec<f64>)>);

impl PhaseParts {
    fn push(&mut self, call: &str, phase: &str, us: f64) {
        let name = format!("{call}: {phase}");
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => v.push(us / 1e3),
            None => self.0.push((name, vec![us / 1e3])),
        }
    }

    /// A sample's phases of `call` in this process.
    pub(super) fn add(&mut self, call: &str, phases: &[(&'static str, f64)]) {
        for &(phase, us) in phases {
            self.push(call, phase, us);
        }
    }

    /// A sample's phases of `call` in the consumer (`{phase: µs}`; absent
    /// or of another shape: none).
    pub(super) fn add_json(&mut self, call: &str, phases: &serde_json::Value) {
        for (phase, us) in phases.as_object().into_iter().flatten() {
            if let Some(us) = us.as_f64() {
                self.push(call, phase, us);
            }
        }
    }

    pub(super) fn into_row(self, mut row: Row) -> Row {
        for (name, samples) in &self.0 {
            row = row.part(name, samples);
        }
        row
    }
}

#[cfg(test)]
mod tests {
    use super::PhaseParts;
    use crate::report::Row;
    use serde_json::json;

    #[test]
    fn phases_of_each_sample_become_parts_in_ms() {
        let mut p = PhaseParts::default();
        p.add("publish", &[("record", 100.0), ("encode", 40.0)]);
        p.add("publish", &[("record", 300.0), ("encode", 60.0)]);
        p.add_json("attach_set", &json!({ "request": 50.0, "bad": "x" }));
        // Another shape (an older consumer without phases) adds nothing.
        p.add_json("attach_set", &serde_json::Value::Null);
        let row = p.into_row(Row::new("ours", "ms"));
        let keys: Vec<&str> = row.parts.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            ["attach_set: request", "publish: encode", "publish: record"]
        );
        assert_eq!(row.parts["publish: record"].n, 2);
        assert!((row.parts["publish: encode"].max - 0.06).abs() < 1e-12);
        assert!((row.parts["attach_set: request"].p50 - 0.05).abs() < 1e-12);
    }
}
