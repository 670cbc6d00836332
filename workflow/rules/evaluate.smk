# Stage 3: one drafter on one dataset, from the cached states of that drafter's layer set; with
# evaluation.checkpoints_per_job > 1, several drafters of one layer set per job and process (docs/running.md).
EVAL_STORE = f"{RESULTS}/eval-store"


if config["evaluation"]["checkpoints_per_job"] == 1:

    rule evaluate:
        input:
            hidden=lambda w: hidden_cache(w.drafter, w.dataset),
            completions=COMPLETIONS,
            checkpoint=lambda w: checkpoint_inputs(w.drafter),
            target=target_inputs,
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
                evaluate_settings(config, w.drafter, w.dataset)
            ),
            checkpoint=lambda w: checkpoint_fingerprint(w.drafter),
            target=target_fingerprint,
            placement=lambda w: f"{BENCH}/evaluate/{w.drafter}/{w.dataset}.gpu.json",
        shell:
            code_prefix("evaluate")
            + "dflash-eval --log {log} evaluate --settings {params.settings:q} --hidden {input.hidden}"
            " --completions {input.completions} --metrics {output.metrics} --samples {output.samples}"
            " --placement {params.placement} 2>> {log}"

else:
    # One job per (group, dataset): a rule per group, since a rule's outputs are fixed (the group's drafters) and
    # only the dataset is a wildcard. Finished checkpoints are kept in EVAL_STORE (evaluate/result_store.py), so
    # Snakemake's removal of the job's outputs before a rerun costs only the restore of the unchanged ones.
    for _first, _members in evaluation_groups().items():

        rule:
            name:
                f"evaluate_group_{re.sub(r'[^A-Za-z0-9_]', '_', _first)}"
            input:
                hidden=lambda w, m=_members: hidden_cache(m[0], w.dataset),
                completions=COMPLETIONS,
                checkpoint=lambda w, m=_members: [
                    f for d in m for f in checkpoint_inputs(d)
                ],
                target=target_inputs,
            output:
                metrics=expand(METRICS, drafter=_members, dataset="{dataset}"),
                samples=expand(SAMPLES, drafter=_members, dataset="{dataset}"),
            log:
                f"{LOGS}/evaluate/group-{_first}/{{dataset}}.log",
            benchmark:
                f"{BENCH}/evaluate/group-{_first}/{{dataset}}.tsv"
            threads: 2
            resources:
                gpu=lambda w: 0 if config["evaluation"]["device"] == "cpu" else 1,
            params:
                members=lambda w, m=_members: [
                    evaluation_member(d, w.dataset) for d in m
                ],
                checkpoint=lambda w, m=_members: [checkpoint_fingerprint(d) for d in m],
                target=target_fingerprint,
                store=EVAL_STORE,
                placement=lambda w, f=_first: f"{BENCH}/evaluate/group-{f}/{w.dataset}.gpu.json",
            shell:
                code_prefix("evaluate")
                + "dflash-eval --log {log} evaluate --member {params.members:q} --hidden {input.hidden}"
                " --completions {input.completions} --store {params.store}"
                " --placement {params.placement} 2>> {log}"
