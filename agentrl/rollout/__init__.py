"""agentrl.rollout"""
