"""agentrl.trajectory"""
