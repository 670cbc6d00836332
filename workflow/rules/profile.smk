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
