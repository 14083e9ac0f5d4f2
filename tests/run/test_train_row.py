from agentrl.run.bookkeeping import train_row


def test_trainer_metrics_go_under_train_and_the_moe_routers_keep_their_namespace():
    row = train_row({"loss": 0.5, "moe/aux_loss": 1.2, "moe/load_max": 2.0, "grad_norm": 1.0})
    assert row == {"train/loss": 0.5, "moe/aux_loss": 1.2, "moe/load_max": 2.0, "train/grad_norm": 1.0}
