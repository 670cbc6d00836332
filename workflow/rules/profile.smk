# Opt-in (profile_server.enabled): dflash-eval profile-server measures T_AR and T_step at forced acceptance lengths
# on the managed server, restarting it once per setting (the configured server is paused meanwhile and restored
# after). Its JSON feeds the report (the profile beside the estimate). server_lock keeps it apart from fetch and
# extraction. docs/speedup.md, "The real engine's own numbers".
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
            settings=settings_param(cfg.profile_server_settings(config)),
        shell:
            code_prefix("profile-server")
            + "dflash-eval --log {log} profile-server --settings {params.settings:q}"
            " --completions {input.completions} --out {output} 2>> {log}"
