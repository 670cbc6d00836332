# The same states through both Gated DeltaNet kernel backends (fla and torch), for the drafters and datasets that
# config.yaml's backend_comparison names: what a cache made with the other backend than training used does to tau.


rule compare_backends:
    input:
        completions=COMPLETIONS,
        target=target_inputs,
        drafter=lambda w: checkpoint_inputs(w.drafter),
    output:
        BACKENDS,
    log:
        f"{LOGS}/backends/{{drafter}}/{{dataset}}/{{dtype}}.log",
    benchmark:
        f"{BENCH}/backends/{{drafter}}/{{dataset}}/{{dtype}}.tsv"
    wildcard_constraints:
        dtype="bfloat16|float32",
    resources:
        gpu=1,
    params:
        target=config["target"]["path"],
        checkpoint=lambda w: config["drafters"][w.drafter]["path"],
        drafter_config=lambda w: (
            f"--drafter-config {config['drafters'][w.drafter]['config']}"
            if config["drafters"][w.drafter]["config"]
            else ""
        ),
        layers=lambda w: ",".join(str(i) for i in drafter_layer_ids(config, w.drafter)),
        last_layer=lambda w: drafter_last_layer(config, w.drafter),
        device=config["target"]["device"],
        max_samples=config["backend_comparison"]["max_samples"],
    shell:
        code_prefix("compare-backends")
        + "dflash-eval --log {log} compare-backends --target {params.target} --completions {input.completions}"
        " --layers {params.layers} --last-layer {params.last_layer} --drafter {params.checkpoint}"
        " {params.drafter_config} --device {params.device} --dtype {wildcards.dtype}"
        " --max-samples {params.max_samples} --out {output} > /dev/null 2>> {log}"
