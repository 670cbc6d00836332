# The embedded demo: tokenizer, tiny hybrid target and DFlash drafters, built once, seeded.
DEMO = config.get("demo", {})
DEMO_STEPS = DEMO.get("drafter_steps", [100, 400, 1200])
DEMO_DRAFTERS = ["untrained"] + [f"step{s}" for s in DEMO_STEPS]


rule demo_tokenizer:
    output:
        f"{DEMO_DIR}/tokenizer/tokenizer.json",
    params:
        seed=DEMO.get("seed", 0),
        out=f"{DEMO_DIR}/tokenizer",
    log:
        f"{LOGS}/demo/tokenizer.log",
    benchmark:
        f"{BENCH}/demo/tokenizer.tsv"
    shell:
        "dflash-eval --log {log} demo-tokenizer --out {params.out} --seed {params.seed} > /dev/null 2>> {log}"


rule demo_target:
    input:
        rules.demo_tokenizer.output,
    output:
        f"{DEMO_DIR}/target/config.json",
        f"{DEMO_DIR}/target/model.safetensors",
        f"{DEMO_DIR}/target/generation_config.json",
    params:
        seed=DEMO.get("seed", 0),
        steps=DEMO.get("target_steps", 600),
        tokenizer=f"{DEMO_DIR}/tokenizer",
        out=f"{DEMO_DIR}/target",
    threads: 2
    log:
        f"{LOGS}/demo/target.log",
    benchmark:
        f"{BENCH}/demo/target.tsv"
    shell:
        "dflash-eval --log {log} demo-target --tokenizer {params.tokenizer} --out {params.out}"
        " --seed {params.seed} --steps {params.steps} > /dev/null 2>> {log}"


rule demo_drafters:
    input:
        rules.demo_target.output,
    output:
        expand(f"{DEMO_DIR}/drafters/{{name}}/{{file}}", name=DEMO_DRAFTERS, file=["config.json", "model.safetensors"]),
        expand(f"{DEMO_DIR}/drafters/checkpoints/step_{{step}}.pt", step=[0] + DEMO_STEPS),
    params:
        seed=DEMO.get("seed", 0),
        steps=" ".join(str(s) for s in DEMO_STEPS),
        target=f"{DEMO_DIR}/target",
        out=f"{DEMO_DIR}/drafters",
    threads: 2
    log:
        f"{LOGS}/demo/drafters.log",
    benchmark:
        f"{BENCH}/demo/drafters.tsv"
    shell:
        "dflash-eval --log {log} demo-drafters --target {params.target} --out {params.out}"
        " --steps {params.steps} --seed {params.seed} --threads {threads} > /dev/null 2>> {log}"
