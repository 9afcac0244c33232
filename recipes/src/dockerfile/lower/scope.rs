//! The variables in scope at an instruction, and the predefined proxy build args.

use super::*;

/// The predefined proxy build args, by the upper-case spelling; a build arg is one of them
/// whatever its case (BuildKit's `proxyEnvFromBuildArgs` matches with `strings.EqualFold`).
pub(super) const PROXY_ARGS: [&str; 5] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "FTP_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
];

/// The proxy variable `name` sets, in upper case, if it is one.
pub(super) fn proxy_arg(name: &str) -> Option<&'static str> {
    PROXY_ARGS
        .into_iter()
        .find(|p| p.eq_ignore_ascii_case(name))
}

/// The proxy build args given, one value per variable: of several spellings of one, the
/// last in byte order wins, as BuildKit's `proxyEnvFromBuildArgs` visits them sorted.
pub(super) fn proxy_env_of(build_args: &BTreeMap<String, String>) -> Vec<(&'static str, &str)> {
    let mut out: Vec<(&'static str, &str)> = Vec::new();
    for (name, value) in build_args {
        if let Some(upper) = proxy_arg(name) {
            match out.iter_mut().find(|(u, _)| *u == upper) {
                Some(slot) => slot.1 = value,
                None => out.push((upper, value)),
            }
        }
    }
    out.sort_by_key(|(u, _)| PROXY_ARGS.iter().position(|p| p == u));
    out
}

/// The variables in scope at an instruction. Lookups go through name indexes, so a
/// hostile `ENV` with a hundred thousand pairs stays linear; env and ARGs are persistent
/// maps, so a stage built on another one shares its parent's rather than copying them
/// (issue 44 §3).
///
/// As in BuildKit, `ENV` and an `ARG` with a value write one environment, the one `$VAR`
/// expands from and `RUN` gets, and the later write of a name wins (`dispatchEnv` and
/// `dispatchArg` both add to the stage's state env); only `ENV` reaches the image config.
/// Here `env` is what `ENV` set (the config's env) and `args` the ARGs whose value is the
/// later write: [`Scope::set_env`] removes an ARG of its name.
#[derive(Debug, Clone, Default)]
pub(super) struct Scope {
    /// `ENV`, in definition order.
    pub(super) env: EnvMap,
    /// ARGs with a value no later `ENV` of their name replaced, in declaration order (an
    /// ARG without a value writes nothing).
    pub(super) args: EnvMap,
    /// ARGs of this stage written over a name of the config's env, which a stage built on
    /// this one gets back from the config ([`Scope::for_child_stage`]).
    pub(super) over_config: Vec<String>,
    /// The base's env is unknown: `$PATH` falls back to Docker's default PATH, which
    /// nearly every Linux base image sets (and BuildKit gives `RUN` when a base has none).
    pub(super) default_path: bool,
}

impl Scope {
    /// Whether the image config's env has `name` (a base whose env is unknown has `PATH`).
    pub(super) fn config_has(&self, name: &str) -> bool {
        self.env.contains(name) || (self.default_path && name == "PATH")
    }

    pub(super) fn get(&self, name: &str) -> Option<String> {
        if let Some(v) = self.args.get(name) {
            return Some(v.to_string());
        }
        if let Some(v) = self.env.get(name) {
            return Some(v.to_string());
        }
        (self.default_path && name == "PATH").then(|| DEFAULT_PATH.to_string())
    }

    /// `ENV key=value`: it replaces the value of an ARG of that name.
    pub(super) fn set_env(&mut self, key: &str, value: &str) {
        self.env.set(key, value);
        self.args.remove(key);
    }

    /// `ARG key[=value]`. Without a value it writes nothing, so a value the name had stays
    /// (BuildKit's `dispatchArg` and `buildMetaArgs` add nothing for an ARG without one).
    pub(super) fn set_arg(&mut self, key: &str, value: Option<&str>) {
        if let Some(v) = value {
            if self.config_has(key) {
                self.over_config.push(key.to_string());
            }
            self.args.set(key, v);
        }
    }

    /// The scope a stage built on this one starts with: the same env and ARGs, with the
    /// config's env put over them again, so an ARG written over a name of the config's env
    /// loses there (BuildKit's `dispatchState.init` takes the base's state and build args,
    /// then `dispatchStages` adds each config `Env` entry to the state again).
    pub(super) fn for_child_stage(&self) -> Scope {
        let mut child = Scope {
            env: self.env.clone(),
            args: self.args.clone(),
            over_config: Vec::new(),
            default_path: self.default_path,
        };
        for k in &self.over_config {
            if child.config_has(k) {
                child.args.remove(k);
            }
        }
        child
    }

    /// The env as `KEY=value` strings, in definition order.
    pub(super) fn env_strings(&self) -> Vec<String> {
        self.env
            .entries()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }
}
