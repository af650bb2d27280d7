"""Bug (for packing): the rows packed into one sequence by concatenating their real tokens,
under the model's plain causal mask and with positions counting on across rows: every row
attends to the rows packed before it, at positions it never had padded (a packed batch
without its block-diagonal mask or position resets)."""

import torch

from grpolab import core


def sequence_logprobs(
    model, input_ids, attention_mask, completion_mask, temperature=1.0, return_entropy=False,
    packed=False,
):  # fmt: skip
    if not packed:
        return core.sequence_logprobs(
            model, input_ids, attention_mask, completion_mask, temperature, return_entropy
        )
    real = attention_mask.bool()
    ids = input_ids[real][None]  # [1, N]: the rows' real tokens, row after row
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    logits = model(input_ids=ids, position_ids=positions).logits[0, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # [N-1]
    index = torch.full_like(input_ids, -1)
    index[real] = torch.arange(ids.shape[1], device=ids.device)
    mask = completion_mask[:, 1:].float()  # [B, T-1]: column t predicts token t+1
    predictor = (index[:, 1:] - 1).clamp(min=0)  # the packed index before token t+1's
    logp = torch.where(mask.bool(), logp_all[predictor], torch.zeros_like(mask))
    return logp, mask
