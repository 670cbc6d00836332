# The inference server at the end of a run (fetch and extract control it themselves, through dflash-eval).
import subprocess


def finish_server() -> None:
    """onsuccess/onerror: restore a server that a killed extraction left down (idempotent: nothing to do
    when every extraction restored it), then stop a managed server this run launched unless keep_running.

    A failure is reported, not raised: Snakemake has already decided the run's outcome.
    """
    settings = settings_param(cfg.server_settings(config))
    done = subprocess.run(["dflash-eval", "server", "finish", "--settings", settings], check=False)
    if done.returncode != 0:
        print(f"dflash-eval server finish exited with {done.returncode}: check the server "
              f"({config['server']['base_url']}) and {config['server']['log_dir']}/transitions.jsonl")
