# profile_target: the target's serving step (T_AR, T_verify(n)) timed once per target, device, dtype and backend,
# for the expected speedup that the report makes (docs/speedup.md). Only where speedup.measure times it (true, or
# auto on CUDA) and no speedup.profile is named. Where the server shares the target's GPU (server.shares_target_gpu,
# the default) it pauses the server as extraction does (the same --runtime) and server_lock keeps it apart from fetch
# and extraction; where not, the server keeps serving and fetch, extraction and this rule take no server_lock (a
# fetch still takes it while profile_server may restart the server). Its params decide the profile: the target, the timing settings and
# what picks the sizes it times (the configured methods); a change re-times it and reruns the report only.
if TARGET_PROFILE:

    rule profile_target:
        input:
            target=target_inputs,
            drafter_configs=drafter_config_inputs,
        output:
            TARGET_PROFILE,
        log:
            f"{LOGS}/profile_target.log",
        benchmark:
            f"{BENCH}/profile_target.tsv"
        threads: 2
        resources:
            server_lock=lambda w: int(config["server"]["shares_target_gpu"]),
            gpu=lambda w: 0 if config["target"]["device"] == "cpu" else 1,
        params:
            settings=settings_param(target_profile.params(config)),
            target=target_fingerprint,
        shell:
            code_prefix("profile-target")
            + 'dflash-eval --log {log} profile-target --settings {params.settings:q} --runtime "$DFLASH_EVAL_EXTRACT_RUNTIME"'
            " --out {output} 2>> {log}"


# Opt-in (profile_server.enabled): dflash-eval profile-server measures T_AR and T_step at forced acceptance lengths
# on the managed server, restarting it once per setting (the configured server is paused meanwhile and restored
# after). Its JSON feeds the report (the profile beside the estimate). server_lock keeps it apart from fetch and
# extraction. docs/speedup.md, "The real engine's own numbers".
# Only what decides the measurement is a param (server_profile.measurement_params: the command without its port, the
# model, the acceptance lengths and request shape); how the server is reached and handled goes in --runtime, through
# the environment as fetch's and extract's does, so that changing it re-profiles nothing.
os.environ[server_profile.RUNTIME_ENV] = cfg.settings_json(
    server_profile.runtime(config)
)

if config["profile_server"]["enabled"]:

    rule profile_server:
        input:
            completions=COMPLETIONS.format(
                dataset=server_profile.profile_dataset(config)
            ),
            target=target_inputs,
            served_drafter=served_drafter_inputs,
        output:
            SERVER_PROFILE,
        log:
            f"{LOGS}/profile_server.log",
        benchmark:
            f"{BENCH}/profile_server.tsv"
        resources:
            server_lock=1,
        params:
            settings=settings_param(server_profile.measurement_params(config)),
        shell:
            code_prefix("profile-server")
            + "dflash-eval --log {log} profile-server --settings {params.settings:q}"
            ' --runtime "$DFLASH_EVAL_PROFILE_SERVER_RUNTIME"'
            " --completions {input.completions} --out {output} 2>> {log}"
