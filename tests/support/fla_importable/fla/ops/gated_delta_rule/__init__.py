"""The two kernels transformers resolves from fla (`fla.ops.gated_delta_rule`), refusing as Triton does on CPU."""

REFUSAL = "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"  # Triton's own words


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    raise ValueError(f"{REFUSAL} [stand-in fla: a CPU forward reached fla's kernel; bind the torch backend]")


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    raise ValueError(f"{REFUSAL} [stand-in fla: a CPU forward reached fla's kernel; bind the torch backend]")
