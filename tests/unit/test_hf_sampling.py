"""The HF reference loop's response log-probs: a left-padded batch gives each row's unpadded log-probs."""
import torch

from moe_lora_rl.data.hf_sampling import generate, prompt_ids, response_logprobs
from moe_lora_rl.data.task import Problem


def test_padded_batch_logprobs_match_unpadded_rows():
    import transformers

    from moe_lora_rl.models import get_model

    path = get_model("glm4_moe", "tiny")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = [Problem((3, 1, 4), 0), Problem((3, 1, 4, 1, 5, 9), 1), Problem((2, 7, 1, 8), 2)]
    prompts = prompt_ids(tok, problems)
    assert len({len(p) for p in prompts}) == 3                   # three lengths: rows are left-padded differently
    responses = generate(model, tok, prompts, max_new_tokens=5, greedy=False, seed=0)
    responses = [r if r else [tok.eos_token_id] for r in responses]
    with torch.no_grad():
        logp, mask = response_logprobs(model, prompts, responses, tok.pad_token_id)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ref, _ = response_logprobs(model, [p], [r], tok.pad_token_id)     # one row: no padding at all
            n = len(r)
            assert mask[i].sum() == n
            torch.testing.assert_close(logp[i, :n], ref[0, :n], rtol=0, atol=1e-4)   # fp32, other batch shapes
        # negative control: without the attention mask the padded rows attend to their padding
        P = max(len(p) for p in prompts)
        T = logp.shape[1]
        ids = torch.full((3, P + T), tok.pad_token_id)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        bad = torch.log_softmax(model(input_ids=ids).logits[:, P - 1:P + T - 1], -1)
        bad = bad.gather(-1, ids[:, P:P + T, None]).squeeze(-1)
        shortest = min(range(3), key=lambda i: len(prompts[i]))
        assert (bad[shortest] - logp[shortest]).abs().max() > 1e-3
