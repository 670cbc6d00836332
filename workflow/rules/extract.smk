# Stage 2: the target's hidden states at one layer set, with the server stopped or freed meanwhile.


rule extract:
    input:
        completions=COMPLETIONS,
        target=target_inputs,
    output:
        directory(HIDDEN),
    log:
        f"{LOGS}/extract/{{dataset}}/{{layerset}}.log",
    benchmark:
        f"{BENCH}/extract/{{dataset}}/{{layerset}}.tsv"
    threads: 2
    resources:
        server_lock=lambda w: int(config["server"]["shares_target_gpu"]),
        gpu=lambda w: 0 if config["target"]["device"] == "cpu" else 1,
    params:
        settings=lambda w: settings_param(
            extract_params(
                config,
                w.dataset,
                parse_layerset(w.layerset),
                layerset_last_layer(w.layerset),
            )
        ),
        target=target_fingerprint,
    shell:
        code_prefix("extract")
        + 'dflash-eval --log {log} extract --settings {params.settings:q} --runtime "$DFLASH_EVAL_EXTRACT_RUNTIME"'
        " --completions {input.completions}"
        " --out {output} 2>> {log}"
