# Stage 1: greedy completions from the live server (OpenAI API). Resumable: finished records collect in
# {output}.partial (not an output, so Snakemake keeps it when it reruns the rule); a rerun sends only the rest.


rule fetch:
    input:
        prompts=lambda w: dataset_inputs(config, w.dataset),
        target=target_inputs,
        served_drafter=served_drafter_inputs,
    output:
        COMPLETIONS,
    log:
        f"{LOGS}/fetch/{{dataset}}.log",
    benchmark:
        f"{BENCH}/fetch/{{dataset}}.tsv"
    resources:
        server_lock=lambda w: int(
            config["server"]["shares_target_gpu"]
            or config["profile_server"]["enabled"]
        ),
    params:
        settings=lambda w: settings_param(fetch_params(config, w.dataset)),
        prompts=lambda w: prompts_fingerprint(w.dataset),
        target=target_fingerprint,
    shell:
        code_prefix("fetch", config["server"]["engine"])
        + 'dflash-eval --log {log} fetch --settings {params.settings:q} --runtime "$DFLASH_EVAL_FETCH_RUNTIME"'
        " --out {output} 2>> {log}"
