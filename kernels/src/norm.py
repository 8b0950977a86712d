"""RMSNorm, plain and fused with the residual add (Hugging Face LlamaRMSNorm numerics on the torch path)."""

from __future__ import annotations

import torch

from ._flashinfer import load_flashinfer, use_flashinfer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, computed in float32 and cast back before the weight, exactly as
    Hugging Face's ``LlamaRMSNorm``.

    x: [N, hidden] (any leading dims); weight: [hidden]. Returns x's shape in ``promote(weight, x)`` dtype.

    FlashInfer's ``norm.rmsnorm`` runs instead when x is a 2-D float16/bfloat16 CUDA tensor of weight's dtype (and
    its ``norm`` kernels are prebuilt or compilable). It is not bit-exact with Hugging Face: it keeps float32 inside,
    weight multiply included, and rounds once at the end, where Hugging Face rounds before the weight multiply and
    again after it; the two differ by about one rounding of x's dtype (bf16: 2**-8 relative).
    """
    if x.dim() == 2 and weight.dtype == x.dtype and x.stride(-1) == 1 and use_flashinfer(x, module="norm"):
        return load_flashinfer().norm.rmsnorm(x, weight, eps)
    dtype = x.dtype
    xf = x.float()
    # Hugging Face's ops and roundings, with one fresh [N, hidden] buffer instead of three (on the CPU a large
    # allocation costs page faults): x * x is what pow(2) computes, and the products reuse the squares' buffer
    out = torch.mul(xf, xf)
    variance = out.mean(-1, keepdim=True)
    out = torch.mul(xf, torch.rsqrt(variance.add_(eps)), out=out).to(dtype)
    if weight.dtype == out.dtype:
        return out.mul_(weight)  # out is a fresh tensor; a product is the same either way round
    return weight * out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual`` (the decoder layer's pre-norm step).

    x, residual: [N, hidden] of one dtype; weight: [hidden]. Returns ``(normed, new_residual)``, both [N, hidden].
    FlashInfer's ``norm.fused_add_rmsnorm`` (contiguous 2-D float16/bfloat16 CUDA tensors) works in place: it
    returns x and residual themselves, overwritten, so callers must not reuse the old values. It adds in float32
    and rounds the new residual once (as the torch path's add does), then normalises the float32 sum, not the
    rounded residual, with one rounding at the end: within about one rounding of x's dtype of the torch path.
    The torch path adds into x in place (the same sum, bit for bit) and returns it as the new residual, so on
    either path x's old values are gone after the call.
    """
    if (x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and weight.dtype == x.dtype
            and residual.dtype == x.dtype and use_flashinfer(x, module="norm")):
        load_flashinfer().norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    if x.shape == residual.shape and x.dtype == residual.dtype and not x.requires_grad:
        residual = x.add_(residual)
    else:
        residual = x + residual
    return rms_norm(residual, weight, eps), residual
