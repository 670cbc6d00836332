# Stage 3: one drafter on one dataset, from the cached states of that drafter's layer set.
from dflash_eval.cache.serving_profile import load_profile

# A user's serving profile (speedup.profile) is checked now, so a bad field stops the run before any job; it is an
# input of every evaluation (their expected speedup), so editing it reruns the evaluations and the report, nothing else.
SPEEDUP_PROFILE = [config["speedup"]["profile"]] if config["speedup"]["profile"] else []
for _profile in SPEEDUP_PROFILE:
    load_profile(_profile)


rule evaluate:
    input:
        hidden=lambda w: hidden_cache(w.drafter, w.dataset),
        completions=COMPLETIONS,
        checkpoint=lambda w: checkpoint_inputs(w.drafter),
        target=target_inputs,
        profile=SPEEDUP_PROFILE,
    output:
        metrics=METRICS,
        samples=SAMPLES,
    log:
        f"{LOGS}/evaluate/{{drafter}}/{{dataset}}.log",
    benchmark:
        f"{BENCH}/evaluate/{{drafter}}/{{dataset}}.tsv"
    threads: 2
    resources:
        gpu=lambda w: 0 if config["evaluation"]["device"] == "cpu" else 1,
    params:
        settings=lambda w: settings_param(
            cfg.evaluate_settings(config, w.drafter, w.dataset)
        ),
        checkpoint=lambda w: checkpoint_fingerprint(w.drafter),
        target=target_fingerprint,
        code=code_fingerprint("evaluate"),
        placement=lambda w: f"{BENCH}/evaluate/{w.drafter}/{w.dataset}.gpu.json",
    shell:
        "dflash-eval --log {log} evaluate --settings {params.settings:q} --hidden {input.hidden}"
        " --completions {input.completions} --metrics {output.metrics} --samples {output.samples}"
        " --placement {params.placement} 2>> {log}"
