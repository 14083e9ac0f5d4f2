"""agentrl.weights"""
