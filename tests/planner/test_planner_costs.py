from mimo.planner import LayerCost, frozen_aware_costs, llm_upstream_requires_grad
from mimo.planner.costs import frozen_unaware_costs, input_grad_flags


def _layer(f, bi, bw, frozen):
    return LayerCost(forward=f, backward_input=bi, backward_weight=bw, frozen=frozen)


def test_frozen_encoder_trainable_projector_frozen_llm():
    enc = [_layer(1.0, 2.0, 3.0, True), _layer(1.5, 2.5, 3.5, True)]
    proj = _layer(0.25, 0.5, 0.75, False)
    chain = enc + [proj]
    got = frozen_aware_costs(chain)
    # encoder: no trainable layer before it and frozen itself -> forward only;
    # projector: its own weight grad, but nothing before it wants an input grad
    assert got == [enc[0].forward, enc[1].forward, proj.forward + proj.backward_weight]

    llm = [_layer(4.0, 5.0, 6.0, True), _layer(4.0, 5.0, 6.0, True)]
    upstream = llm_upstream_requires_grad([chain])
    assert upstream is True
    # frozen LLM still passes input gradients back to the projector
    assert frozen_aware_costs(llm, upstream) == [l.forward + l.backward_input for l in llm]


def test_all_frozen_is_forward_only():
    chain = [_layer(1.0, 2.0, 3.0, True) for _ in range(4)]
    assert frozen_aware_costs(chain) == [1.0] * 4
    assert llm_upstream_requires_grad([chain]) is False


def test_upstream_grad_charges_first_frozen_layer():
    chain = [_layer(1.0, 2.0, 3.0, True), _layer(1.0, 2.0, 3.0, True)]
    assert frozen_aware_costs(chain, upstream_requires_grad=True) == [1.0 + 2.0, 1.0 + 2.0]


def test_first_trainable_layer_has_no_input_grad():
    # refinement over Eq. 3.3: the first trainable layer computes no input grad
    a, b, c = _layer(1.0, 2.0, 3.0, False), _layer(1.0, 2.0, 3.0, False), _layer(1.0, 2.0, 3.0, True)
    assert input_grad_flags([a, b, c]) == [False, True, True]
    assert frozen_aware_costs([a, b, c]) == [
        a.forward + a.backward_weight,
        b.forward + b.backward_input + b.backward_weight,
        c.forward + c.backward_input,
    ]


def test_trainable_in_the_middle_only_downstream_pays_input_grads():
    chain = [_layer(1.0, 10.0, 100.0, True), _layer(2.0, 20.0, 200.0, False), _layer(3.0, 30.0, 300.0, True)]
    assert frozen_aware_costs(chain) == [1.0, 2.0 + 200.0, 3.0 + 30.0]
    assert frozen_unaware_costs(chain) == [111.0, 222.0, 333.0]


def test_trainable_encoder_makes_llm_upstream_grad():
    frozen = [_layer(1, 1, 1, True)]
    trainable = [_layer(1, 1, 1, False)]
    assert llm_upstream_requires_grad([frozen, trainable]) is True
    assert llm_upstream_requires_grad([]) is False
