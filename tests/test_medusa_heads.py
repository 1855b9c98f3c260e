"""MedusaHeads: checkpoint key names, loading, fused forward vs the logits path.
(The loss and the training step: tests/test_medusa_training.py.)"""
import pytest
import torch

from python_ref import medusa as ref
from specdec_kernels.drafting.medusa.heads import MedusaHeads, load_medusa_heads


def randomize(heads: MedusaHeads, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return heads


def medusa_checkpoint(K, L, H, V, per_head=True, prefix="", seed=0):
    """A state dict laid out like the published Medusa files (medusa_lm_head.pt)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k in range(K):
        for j in range(L):
            sd[f"{prefix}{k}.{j}.linear.weight"] = torch.randn(H, H, generator=g) / H**0.5
            sd[f"{prefix}{k}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.1
        if per_head:
            sd[f"{prefix}{k}.{L}.weight"] = torch.randn(V, H, generator=g) / H**0.5
    return sd


def test_state_dict_keys_match_medusa():
    heads = MedusaHeads(8, 20, num_heads=2, num_layers=1)
    assert sorted(heads.state_dict()) == sorted(
        ["medusa_head.0.0.linear.weight", "medusa_head.0.0.linear.bias", "medusa_head.0.1.weight",
         "medusa_head.1.0.linear.weight", "medusa_head.1.0.linear.bias", "medusa_head.1.1.weight"]
    )
    shared = MedusaHeads(8, 20, num_heads=2, num_layers=2, lm_head_weight=torch.randn(20, 8))
    assert sorted(shared.state_dict()) == sorted(
        f"medusa_head.{k}.{j}.linear.{w}" for k in range(2) for j in range(2) for w in ("weight", "bias")
    )


def test_init_is_identity_resblocks():
    heads = MedusaHeads(8, 20, num_heads=3, num_layers=2)
    h = torch.randn(4, 8)
    logits = heads.logits(h)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], h @ heads.medusa_head[k][2].weight.T)


@pytest.mark.parametrize("prefix", ["", "medusa_head."])
@pytest.mark.parametrize("K,L", [(3, 1), (2, 2), (1, 0)])
def test_load_checkpoint_and_forward_matches_reference(tmp_path, prefix, K, L):
    H, V = 12, 90
    sd = medusa_checkpoint(K, L, H, V, prefix=prefix)
    path = tmp_path / "medusa_lm_head.pt"
    torch.save(sd, path)
    heads = load_medusa_heads(path)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (K, L, H, V)
    res_w = torch.stack([torch.stack([sd[f"{prefix}{k}.{j}.linear.weight"] for j in range(L)]) if L else
                         torch.zeros(0, H, H) for k in range(K)])
    res_b = torch.stack([torch.stack([sd[f"{prefix}{k}.{j}.linear.bias"] for j in range(L)]) if L else
                         torch.zeros(0, H) for k in range(K)])
    lm = torch.stack([sd[f"{prefix}{k}.{L}.weight"] for k in range(K)])
    hidden = torch.randn(5, H)
    ids, lp = heads(hidden, top_k=7)
    ref_ids, ref_lp = ref.medusa_topk(hidden, res_w, res_b, lm, 7)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-4, rtol=1e-4)
    assert torch.equal(ids, ref_ids)


def test_load_safetensors_with_shared_lm_head(tmp_path):
    from safetensors.torch import save_file

    H, V = 10, 40
    path = tmp_path / "medusa_lm_head.safetensors"
    save_file(medusa_checkpoint(2, 1, H, V, per_head=False), str(path))
    lm = torch.randn(V, H)
    with pytest.raises(ValueError, match="pass the base model's lm_head_weight"):
        load_medusa_heads(path)
    heads = load_medusa_heads(path, lm_head_weight=lm)
    assert heads.shared_lm_head and "lm_head_weight" not in heads.state_dict()
    hidden = torch.randn(3, H)
    ids, lp = heads(hidden, top_k=5)
    full = torch.log_softmax(heads.logits(hidden).double(), -1)
    torch.testing.assert_close(torch.gather(full, -1, ids), lp.double(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("shared", [True, False])
def test_fused_forward_matches_logits_path(shared):
    H, V = 16, 77
    heads = randomize(MedusaHeads(H, V, num_heads=3, num_layers=1,
                                  lm_head_weight=torch.randn(V, H) if shared else None))
    hidden = torch.randn(2, 4, H)
    ids, lp = heads(hidden, top_k=6)
    assert ids.shape == (8, 3, 6)
    full = torch.log_softmax(heads.logits(hidden).reshape(8, 3, V).double(), -1)
    torch.testing.assert_close(torch.gather(full, -1, ids), lp.double(), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(full.topk(6, dim=-1).values, lp.double(), atol=2e-4, rtol=1e-4)


def test_parameters_share_storage_with_stacked_weights_and_follow_updates():
    heads = randomize(MedusaHeads(8, 30, num_heads=2, num_layers=1))
    res_w, res_b, lm = heads.stacked_weights()
    assert heads.medusa_head[1][0].linear.weight.data_ptr() == res_w[1, 0].data_ptr()
    with torch.no_grad():
        heads.medusa_head[1][1].weight.mul_(2)  # an in-place update (as optimizers do)
    hidden = torch.randn(3, 8)
    full = torch.log_softmax(heads.logits(hidden).double(), -1)
    ids, lp = heads(hidden, top_k=4)
    torch.testing.assert_close(torch.gather(full, -1, ids), lp.double(), atol=2e-4, rtol=1e-4)
    # Replacing parameters (.to) re-stacks.
    heads = heads.to(torch.bfloat16)
    ids_bf, lp_bf = heads(hidden, top_k=4)
    full_bf = torch.log_softmax(heads.logits(hidden.bfloat16()).double(), -1)
    torch.testing.assert_close(torch.gather(full_bf, -1, ids_bf), lp_bf.double(), atol=0.1, rtol=0.05)


def test_bad_checkpoints():
    with pytest.raises(ValueError, match="no Medusa heads"):
        load_medusa_heads({"foo": torch.zeros(1)})
    sd = medusa_checkpoint(2, 1, 4, 9)
    del sd["1.0.linear.bias"]
    with pytest.raises(ValueError, match="missing medusa_head.1.0.linear.bias"):
        load_medusa_heads(sd)
    with pytest.raises(ValueError, match=r"lm_head_weight must have shape \[9, 4\]"):
        MedusaHeads(4, 9, lm_head_weight=torch.zeros(9, 5))
