# The embedded demo: tokenizer, tiny hybrid target and DFlash drafters, built once, seeded.
# Included only with demo.enabled (config.yaml); the settings are the validated config's (defaults in the schema).
DEMO_STEPS = DEMO["drafter_steps"]
DEMO_DRAFTERS = ["untrained"] + [f"step{s}" for s in DEMO_STEPS]
# demo.build_device: where target and drafters train (cpu, or cuda in config/gpu.yaml). Another device rebuilds
# them (other models: docs/demo.md) through the shell command, which Snakemake's code trigger compares; on the CPU
# (the default) the command is what it was before the setting existed, so a CPU demo rebuilds nothing for it.
DEMO_BUILD_DEVICE = DEMO["build_device"]
DEMO_BUILD_GPUS = 0 if DEMO_BUILD_DEVICE == "cpu" else 1
DEMO_DEVICE_ARG = "" if DEMO_BUILD_DEVICE == "cpu" else f" --device {DEMO_BUILD_DEVICE}"


rule demo_tokenizer:
    output:
        tokenizer=f"{DEMO_DIR}/tokenizer/tokenizer.json",
    log:
        f"{LOGS}/demo/tokenizer.log",
    benchmark:
        f"{BENCH}/demo/tokenizer.tsv"
    params:
        seed=DEMO["seed"],
        out=lambda w, output: os.path.dirname(output.tokenizer),
    shell:
        "dflash-eval --log {log} demo-tokenizer --out {params.out} --seed {params.seed} > /dev/null 2>> {log}"


rule demo_target:
    input:
        tokenizer=rules.demo_tokenizer.output.tokenizer,
    output:
        config=f"{DEMO_DIR}/target/config.json",
        weights=f"{DEMO_DIR}/target/model.safetensors",
        generation=f"{DEMO_DIR}/target/generation_config.json",
    log:
        f"{LOGS}/demo/target.log",
    benchmark:
        f"{BENCH}/demo/target.tsv"
    threads: 2
    resources:
        gpu=DEMO_BUILD_GPUS,
    params:
        seed=DEMO["seed"],
        steps=DEMO["target_steps"],
        tokenizer=lambda w, input: os.path.dirname(input.tokenizer),
        out=lambda w, output: os.path.dirname(output.config),
    shell:
        "dflash-eval --log {log} demo-target --tokenizer {params.tokenizer} --out {params.out}"
        " --seed {params.seed} --steps {params.steps}"
        + DEMO_DEVICE_ARG
        + " > /dev/null 2>> {log}"


rule demo_drafters:
    input:
        rules.demo_target.output,
    output:
        models=expand(
            f"{DEMO_DIR}/drafters/{{name}}/{{file}}",
            name=DEMO_DRAFTERS,
            file=["config.json", "model.safetensors"],
        ),
        checkpoints=expand(
            f"{DEMO_DIR}/drafters/checkpoints/step_{{step}}.pt", step=[0] + DEMO_STEPS
        ),
    log:
        f"{LOGS}/demo/drafters.log",
    benchmark:
        f"{BENCH}/demo/drafters.tsv"
    # every core it is given: two torch threads per process (they decide the bits) and one worker process per
    # two cores for the target's greedy training completions (the same bits for any number of workers), on the
    # build's device (a build on CUDA runs them side by side on its GPU)
    threads: workflow.cores
    resources:
        gpu=DEMO_BUILD_GPUS,
    params:
        seed=DEMO["seed"],
        steps=" ".join(str(s) for s in DEMO_STEPS),
        torch_threads=lambda w, threads: min(threads, 2),
        workers=lambda w, threads: max(1, threads // 2),
        target=lambda w, input: os.path.dirname(input[0]),
        out=lambda w, output: os.path.dirname(os.path.dirname(output.checkpoints[0])),
    shell:
        "dflash-eval --log {log} demo-drafters --target {params.target} --out {params.out}"
        " --steps {params.steps} --seed {params.seed} --threads {params.torch_threads} --workers {params.workers}"
        + DEMO_DEVICE_ARG
        + " > /dev/null 2>> {log}"
