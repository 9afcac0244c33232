//! Lowering the instructions with the most options: `HEALTHCHECK`, `RUN` and its mounts,
//! `COPY` and `ADD`.

use super::*;

impl Lowering<'_> {
    pub(super) fn lower_healthcheck(
        &self,
        draft: &Draft,
        h: &HealthcheckArgs,
        offset: usize,
    ) -> Result<Healthcheck, Fault> {
        let dur = |name: &str, v: &Option<String>| -> Result<Option<u64>, Fault> {
            match v {
                None => Ok(None),
                // BuildKit's `parseOptInterval`: 0 means the default, and anything else
                // below `container.MinimumDuration` (1 ms) is refused.
                Some(s) => match parse_duration_exact_ms(s) {
                    Some(0.0) => Ok(None),
                    Some(ms) if ms < 1.0 => Err(invalid(
                        offset,
                        format!("HEALTHCHECK --{name}: '{s}' is less than the minimum of 1ms"),
                    )),
                    // At most 1e15 (checked by the parser): the cast cannot saturate.
                    Some(ms) => Ok(Some(ms.round() as u64)),
                    None => Err(invalid(
                        offset,
                        format!("HEALTHCHECK --{name}: invalid duration '{s}'"),
                    )),
                },
            }
        };
        let retries = match &h.retries {
            None => None,
            Some(r) => match r.parse::<u32>() {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(invalid(
                        offset,
                        format!("HEALTHCHECK --retries: invalid number '{r}'"),
                    ));
                }
            },
        };
        let test = match &h.test {
            None => vec!["NONE".to_string()],
            Some(CommandLine::Exec(v)) => {
                let mut t = vec!["CMD".to_string()];
                t.extend(v.iter().cloned());
                t
            }
            Some(CommandLine::Shell(s)) => vec!["CMD-SHELL".to_string(), s.clone()],
        };
        let _ = draft;
        Ok(Healthcheck {
            test,
            interval_ms: dur("interval", &h.interval)?,
            timeout_ms: dur("timeout", &h.timeout)?,
            start_period_ms: dur("start-period", &h.start_period)?,
            start_interval_ms: dur("start-interval", &h.start_interval)?,
            retries,
        })
    }

    pub(super) fn mount_from(
        &self,
        draft: &mut Draft,
        word: &str,
        count: usize,
        offset: usize,
    ) -> Result<MountFrom, Fault> {
        Ok(match self.resolve_ref(word, count, offset)? {
            Ref::Stage(i) => {
                draft.deps.entry(i).or_insert(offset);
                MountFrom::Stage { stage: i }
            }
            Ref::Image(reference) => MountFrom::Image { reference },
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn lower_run(
        &self,
        draft: &mut Draft,
        mounts: &[(String, usize)],
        network: &Option<String>,
        security: &Option<String>,
        command: &CommandLine,
        heredocs: &[RunHeredoc],
        count: usize,
        offset: usize,
    ) -> Result<RunStep, Fault> {
        let network = match network.as_deref() {
            None | Some("default") => Network::Default,
            Some("none") => Network::None,
            Some("host") => Network::Host,
            Some(other) => {
                return Err(invalid(
                    offset,
                    format!("invalid --network '{other}': expected default, none or host"),
                ));
            }
        };
        let security = match security.as_deref() {
            None | Some("sandbox") => Security::Sandbox,
            // In the plan; the builder runs it only with the security.insecure entitlement.
            Some("insecure") => Security::Insecure,
            Some(other) => {
                return Err(invalid(
                    offset,
                    format!("invalid --security '{other}': expected sandbox or insecure"),
                ));
            }
        };
        let mut lowered = Vec::new();
        let mut ssh_mounts = 0;
        for (raw, at) in mounts {
            let mut m = self.lower_mount(draft, raw, *at, count)?;
            if let Mount::Ssh { target, .. } = &mut m {
                if target.is_empty() {
                    *target = format!("/run/buildkit/ssh_agent.{ssh_mounts}");
                }
                ssh_mounts += 1;
            }
            lowered.push(m);
        }
        let (form, argv, files) = match command {
            CommandLine::Exec(v) => (CommandForm::Exec, v.clone(), Vec::new()),
            CommandLine::Shell(cmd) if heredocs.is_empty() => {
                let mut argv = draft.state.shell.to_vec();
                argv.push(cmd.clone());
                (CommandForm::Shell, argv, Vec::new())
            }
            CommandLine::Shell(cmd) => {
                let words = crate::shell_words::split_words(cmd, '\\');
                let single = words.len() == 1 && heredocs.len() == 1;
                if single {
                    let doc = &heredocs[0];
                    let data = doc.content();
                    if data.starts_with("#!") {
                        let path = format!("/dev/pipes/{}", doc.name);
                        let file = InlineFile {
                            name: doc.name.clone(),
                            data,
                            path: Some(path.clone()),
                            mode: 0o755,
                        };
                        // BuildKit prepends the shell to the script path too.
                        let mut argv = draft.state.shell.to_vec();
                        argv.push(path);
                        (CommandForm::Shell, argv, vec![file])
                    } else {
                        let mut argv = draft.state.shell.to_vec();
                        argv.push(data);
                        (CommandForm::Shell, argv, Vec::new())
                    }
                } else {
                    let mut full = cmd.clone();
                    for doc in heredocs {
                        full.push('\n');
                        full.push_str(&doc.raw);
                        full.push_str(&doc.name);
                    }
                    let mut argv = draft.state.shell.to_vec();
                    argv.push(full);
                    (CommandForm::Shell, argv, Vec::new())
                }
            }
        };
        self.charge(argv.iter().map(|w| w.len() + 24).sum(), offset)?;
        // The proxy build args reach `RUN` without an ARG, in both spellings, after the
        // stage's env (BuildKit: `proxyEnvFromBuildArgs`, the exec op's `proxyEnvList`); a
        // name the stage's env has keeps its value there.
        let mut proxy_env = Vec::new();
        for (upper, value) in proxy_env_of(&self.options.build_args) {
            for name in [upper.to_string(), upper.to_ascii_lowercase()] {
                if draft.scope.get(&name).is_none() {
                    proxy_env.push(format!("{name}={value}"));
                }
            }
        }
        Ok(RunStep {
            form,
            argv,
            files,
            mounts: lowered,
            network,
            security,
            proxy_env,
        })
    }

    pub(super) fn lower_mount(
        &self,
        draft: &mut Draft,
        raw: &str,
        offset: usize,
        count: usize,
    ) -> Result<Mount, Fault> {
        let mut fields: BTreeMap<String, Option<String>> = BTreeMap::new();
        let mut kind = "bind".to_string();
        for field in csv_fields(raw) {
            let (k, v) = match field.split_once('=') {
                Some((k, v)) => (
                    k.trim().to_ascii_lowercase(),
                    Some(self.expand(v, &draft.scope, offset)?),
                ),
                None => (field.trim().to_ascii_lowercase(), None),
            };
            let key = match k.as_str() {
                "dst" | "destination" => "target".to_string(),
                "src" => "source".to_string(),
                "ro" => "readonly".to_string(),
                "rw" => "readwrite".to_string(),
                _ => k,
            };
            if key == "type" {
                kind = v.clone().unwrap_or_default();
                continue;
            }
            let allowed: &[&str] = match kind.as_str() {
                "bind" => &["target", "source", "from", "readonly", "readwrite"],
                "cache" => &[
                    "target",
                    "id",
                    "sharing",
                    "from",
                    "source",
                    "mode",
                    "uid",
                    "gid",
                    "readonly",
                    "readwrite",
                ],
                "tmpfs" => &["target", "size"],
                "secret" => &["target", "id", "required", "mode", "uid", "gid", "env"],
                "ssh" => &["target", "id", "required", "mode", "uid", "gid"],
                other => return Err(invalid(offset, format!("unsupported mount type '{other}'"))),
            };
            if !allowed.contains(&key.as_str()) {
                return Err(invalid(
                    offset,
                    format!("unexpected key '{key}' in --mount type={kind}"),
                ));
            }
            fields.insert(key, v);
        }
        let get = |k: &str| fields.get(k).cloned().flatten();
        let flag = |k: &str| -> Result<bool, Fault> {
            match fields.get(k) {
                None => Ok(false),
                Some(None) => Ok(true),
                Some(Some(v)) => match v.as_str() {
                    "true" | "1" => Ok(true),
                    "false" | "0" => Ok(false),
                    _ => Err(invalid(offset, format!("invalid value for {k}: '{v}'"))),
                },
            }
        };
        let number = |k: &str, radix: u32, default: u32| -> Result<u32, Fault> {
            match get(k) {
                None => Ok(default),
                Some(v) => u32::from_str_radix(&v, radix)
                    .map_err(|_| invalid(offset, format!("invalid {k} '{v}' in --mount"))),
            }
        };
        let target = get("target").map(|t| resolve_path(&draft.state.workdir, &t));
        let from = match get("from") {
            Some(f) => Some(self.mount_from(draft, &f, count, offset)?),
            None => None,
        };
        let readonly = flag("readonly")?;
        let readwrite = flag("readwrite")?;
        Ok(match kind.as_str() {
            "bind" => Mount::Bind {
                target: target
                    .ok_or_else(|| invalid(offset, "--mount type=bind needs a target"))?,
                source: get("source").unwrap_or_default(),
                from,
                readwrite: readwrite && !readonly,
            },
            "cache" => {
                let target =
                    target.ok_or_else(|| invalid(offset, "--mount type=cache needs a target"))?;
                let sharing = get("sharing").unwrap_or_else(|| "shared".into());
                if !["shared", "private", "locked"].contains(&sharing.as_str()) {
                    return Err(invalid(
                        offset,
                        format!("unsupported sharing value '{sharing}'"),
                    ));
                }
                Mount::Cache {
                    id: get("id").unwrap_or_else(|| target.clone()),
                    target,
                    sharing,
                    from,
                    source: get("source"),
                    mode: number("mode", 8, 0o755)?,
                    uid: number("uid", 10, 0)?,
                    gid: number("gid", 10, 0)?,
                    readonly,
                }
            }
            // BuildKit's `dispatchSSH` and `AddSSHSocket`: id `default`, mode 0600, owner
            // 0:0, optional unless `required`; an empty target is given its default by
            // `lower_run`, which knows the mount's place among the step's ssh mounts.
            "ssh" => Mount::Ssh {
                id: get("id")
                    .filter(|i| !i.is_empty())
                    .unwrap_or_else(|| "default".into()),
                target: target.unwrap_or_default(),
                required: flag("required")?,
                mode: number("mode", 8, 0o600)?,
                uid: number("uid", 10, 0)?,
                gid: number("gid", 10, 0)?,
            },
            "tmpfs" => Mount::Tmpfs {
                target: target
                    .ok_or_else(|| invalid(offset, "--mount type=tmpfs needs a target"))?,
                size: match get("size") {
                    None => None,
                    Some(s) => Some(
                        parse_size(&s)
                            .ok_or_else(|| invalid(offset, format!("invalid tmpfs size '{s}'")))?,
                    ),
                },
            },
            _ => {
                let env = get("env");
                let id = match (get("id"), &target) {
                    (Some(id), _) => id,
                    (None, Some(t)) => t.rsplit('/').next().unwrap_or_default().to_string(),
                    (None, None) => {
                        return Err(invalid(
                            offset,
                            "--mount type=secret needs an id or a target",
                        ));
                    }
                };
                let target = match (target, &env) {
                    (Some(t), _) => Some(t),
                    (None, None) => Some(format!("/run/secrets/{id}")),
                    (None, Some(_)) => None,
                };
                Mount::Secret {
                    id,
                    target,
                    env,
                    required: flag("required")?,
                    mode: number("mode", 8, 0o400)?,
                    uid: number("uid", 10, 0)?,
                    gid: number("gid", 10, 0)?,
                }
            }
        })
    }

    pub(super) fn lower_copy(
        &self,
        draft: &mut Draft,
        args: &CopyArgs,
        is_add: bool,
        count: usize,
        offset: usize,
    ) -> Result<CopyStep, Fault> {
        let scope = draft.scope.clone();
        let ex = |w: &str| self.expand(w, &scope, offset);
        let from = match &args.from {
            Some(f) => {
                let f = ex(f)?;
                Some(self.mount_from(draft, &f, count, offset)?)
            }
            None => None,
        };
        let mut sources = Vec::new();
        let mut all_local = true;
        for s in &args.sources {
            sources.push(match s {
                SourceArg::Path(p) => {
                    let p = ex(p)?;
                    let lower = p.to_ascii_lowercase();
                    // Git sources as BuildKit tells them; transports and schemes ADD never
                    // fetches from are refused here (crate::git).
                    let is_git = crate::git::GitRef::parse(&p)
                        .map_err(|e| invalid(offset, e.to_string()))?
                        .is_some();
                    let is_url =
                        !is_git && (lower.starts_with("http://") || lower.starts_with("https://"));
                    if is_url && !url_has_host(&p) {
                        return Err(invalid(offset, format!("URL '{p}' has no host")));
                    }
                    if (is_url || is_git) && !is_add {
                        return Err(invalid(
                            offset,
                            format!("COPY cannot fetch '{p}': use ADD for URLs"),
                        ));
                    }
                    if (is_url || is_git) && from.is_some() {
                        return Err(invalid(
                            offset,
                            "a URL source cannot be combined with --from",
                        ));
                    }
                    if is_git {
                        all_local = false;
                        CopySource::Git { url: p }
                    } else if is_url {
                        all_local = false;
                        CopySource::Url { url: p }
                    } else {
                        CopySource::Path { path: p }
                    }
                }
                SourceArg::Heredoc { name, data, expand } => {
                    let data = if *expand {
                        let mut lookup = |n: &str| scope.get(n);
                        expand_heredoc(data, self.escape, &mut lookup)
                            .map_err(|e| words_fault(offset, e))?
                    } else {
                        data.clone()
                    };
                    CopySource::Inline(InlineFile {
                        name: name.clone(),
                        data,
                        path: None,
                        mode: 0o644,
                    })
                }
            });
        }
        let raw_dest = ex(&args.dest)?;
        let mut dest = resolve_path(&draft.state.workdir, &raw_dest);
        if (raw_dest == "." || raw_dest.is_empty() || raw_dest.ends_with('/'))
            && !dest.ends_with('/')
        {
            dest.push('/');
        }
        let chown = args.chown.as_deref().map(ex).transpose()?;
        let chmod = args.chmod.as_deref().map(ex).transpose()?;
        if let Some(m) = &chmod
            && !valid_chmod(m)
        {
            return Err(invalid(
                offset,
                format!("invalid --chmod '{m}': expected octal (0755) or symbolic (u+x,g-w)"),
            ));
        }
        let checksum = args.checksum.as_deref().map(ex).transpose()?;
        if let Some(c) = &checksum {
            let ok = c.split_once(':').is_some_and(|(alg, hex)| {
                let len = match alg {
                    "sha256" => 64,
                    "sha384" => 96,
                    "sha512" => 128,
                    _ => 0,
                };
                len > 0 && hex.len() == len && hex.chars().all(|c| c.is_ascii_hexdigit())
            });
            if !ok {
                return Err(invalid(
                    offset,
                    format!("invalid --checksum '{c}': expected sha256:<hex>"),
                ));
            }
            if all_local {
                return Err(invalid(
                    offset,
                    "--checksum is only supported with URL sources",
                ));
            }
        }
        let exclude = args
            .exclude
            .iter()
            .map(|e| ex(e))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CopyStep {
            sources,
            dest,
            from,
            chown,
            chmod,
            link: args.link,
            parents: args.parents,
            exclude,
            checksum,
            unpack: is_add && args.unpack.unwrap_or(all_local),
            keep_git_dir: args.keep_git_dir,
        })
    }
}
